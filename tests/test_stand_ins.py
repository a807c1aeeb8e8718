"""install_stand_ins(): Ascend import names served by moe_onnx, never over a real package."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("torch")


def _run(code: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, cwd=cwd, timeout=300
    )


def test_torch_npu_imports_after_install_and_not_before():
    result = _run(
        """
        import importlib.util
        assert importlib.util.find_spec("torch_npu") is None
        import moe_onnx.torch as mt
        import sys
        assert "torch_npu" not in sys.modules  # never implicit
        modules = mt.install_stand_ins()
        import torch_npu
        assert modules["torch_npu"] is torch_npu
        assert torch_npu.npu_moe_re_routing is mt.npu.NAMES["npu_moe_re_routing"]
        assert mt.install_stand_ins()["torch_npu"] is torch_npu  # again: the same module
        print("ok")
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_refused_when_a_real_torch_npu_is_importable(tmp_path):
    (tmp_path / "torch_npu.py").write_text("REAL = True\n")
    result = _run(
        """
        import sys
        import moe_onnx.torch as mt
        try:
            mt.install_stand_ins()
        except ImportError as err:
            print(type(err).__name__, err)
        assert "torch_npu" not in sys.modules
        """,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("RealModuleError install_stand_ins: a real module is importable (torch_npu at ")
    assert str(tmp_path / "torch_npu.py") in result.stdout
