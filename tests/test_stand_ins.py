"""install_stand_ins(): Ascend import names served by moe_onnx, never over a real package."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap

import pytest
import torch  # noqa: F401 - a test dependency: without it these tests fail, not skip


def _run(code: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, cwd=cwd, timeout=300
    )


def test_find_spec_answers_for_the_stand_ins_and_transformers_sees_no_npu():
    """importlib.util.find_spec of a loaded module reads its __spec__ (None raised ValueError:
    transformers' is_torch_npu_available, asked while its Qwen3-MoE model imports, failed);
    with no version and no file, transformers counts torch_npu as not installed."""
    result = _run(
        """
        import importlib.util
        import moe_onnx.torch as mt
        mt.install_stand_ins()
        for name in mt.stand_ins.STAND_INS:
            spec = importlib.util.find_spec(name)
            assert spec.name == name and spec.origin is None and spec.loader is None, name
        assert importlib.util.find_spec("torch_npu").submodule_search_locations == []  # a package
        assert importlib.util.find_spec("torchair.configs.compiler_config").submodule_search_locations is None
        from transformers.utils import is_torch_npu_available
        assert is_torch_npu_available() is False
        from transformers import Qwen3MoeConfig  # imports the modeling code that asked it
        mt.install_stand_ins()  # again: its own modules are not "a real module"
        """
    )
    assert result.returncode == 0, result.stderr


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
        assert torch_npu.hifloat8 == 290  # torch_npu's dtype constant (byte storage)
        import cann_ops_transformer
        from cann_ops_transformer.ops import moe_init_routing, moe_init_routing_grad
        from moe_onnx.torch import ops_transformer
        assert cann_ops_transformer.ops is modules["cann_ops_transformer.ops"]
        assert moe_init_routing is cann_ops_transformer.moe_init_routing is ops_transformer.moe_init_routing
        assert cann_ops_transformer.moe_re_routing is ops_transformer.moe_re_routing
        assert moe_init_routing_grad is cann_ops_transformer.moe_init_routing_grad
        import torchair as tng
        from torchair.configs.compiler_config import CompilerConfig
        config = CompilerConfig()
        config.experimental_config.keep_inference_input_mutations = True
        assert tng.get_npu_backend(compiler_config=config) == "inductor"
        config.debug.graph_dump = True
        try:
            tng.get_npu_backend(compiler_config=config)
        except NotImplementedError as err:
            assert "CompilerConfig.debug.graph_dump is not supported" in str(err)
        else:
            raise AssertionError("an option the CPU path does not reproduce was ignored")
        assert mt.install_stand_ins()["torch_npu"] is torch_npu  # again: the same module
        print("ok")
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_refused_when_a_real_module_is_importable(tmp_path):
    for real in ("torch_npu", "cann_ops_transformer"):
        (tmp_path / f"{real}.py").write_text("REAL = True\n")
    result = _run(
        """
        import sys
        import moe_onnx.torch as mt
        try:
            mt.install_stand_ins()
        except ImportError as err:
            print(type(err).__name__, err)
        assert not {"torch_npu", "cann_ops_transformer", "torchair"} & set(sys.modules)  # nothing registered
        """,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("RealModuleError install_stand_ins: a real module is importable (torch_npu at ")
    assert f"torch_npu at {tmp_path / 'torch_npu.py'}; cann_ops_transformer at " in result.stdout
    assert str(tmp_path / "cann_ops_transformer.py") in result.stdout


@pytest.mark.parametrize(
    "option, value",
    [
        ("mode", "reduce-overhead"),  # a top-level option (vllm-ascend, sglang)
        ("debug.graph_dump.type", "pbtxt"),  # nested (TorchAir's own examples)
        ("aoe_config.aoe_mode", "1"),  # a group the stand-in does not list
        ("experimental_config.frozen_parameter", True),
    ],
)
def test_every_torchair_option_set_is_refused_by_name(option, value):
    """TorchAir options are set at any depth; each one set (but the harmless one) is refused
    naming its path, never ignored and never a bare AttributeError."""
    from moe_onnx.torch.graph_mode import CompilerConfig, get_npu_backend

    config = CompilerConfig()
    config.experimental_config.keep_inference_input_mutations = True
    assert get_npu_backend(compiler_config=config) == "inductor"
    *groups, name = option.split(".")
    target = config
    for group in groups:
        target = getattr(target, group)
    setattr(target, name, value)
    with pytest.raises(NotImplementedError, match=rf"CompilerConfig\.{re.escape(option)} is not supported"):
        get_npu_backend(compiler_config=config)
