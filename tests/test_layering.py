"""Imports run one way, down, at load time too (docs/architecture.md)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def loaded_modules(statement: str, cwd: str | None = None) -> set[str]:
    program = f"import sys\n{statement}\nprint(' '.join(sorted(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, cwd=cwd, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return set(result.stdout.split())


@pytest.mark.parametrize("package", ["moe_onnx.custom_ops", "moe_onnx.converters"])
def test_the_lower_layers_load_no_onnxruntime(package):
    loaded = loaded_modules(f"import {package}")
    banned = ("onnxruntime", "moe_onnx.session", "numba", "torch", "transformers", "moe_onnx.transformers")
    assert not {m for m in loaded if m.startswith(banned)}
    assert "moe_onnx.custom_ops" in loaded  # (and the schemas are registered with it)


def test_the_front_door_loads_the_session_when_asked():
    assert not {"onnxruntime", "transformers"} & loaded_modules("import moe_onnx")
    assert "moe_onnx.session" in loaded_modules("import moe_onnx; moe_onnx.InferenceSession")


def test_the_torch_frontend_loads_no_transformers():
    """moe_onnx.transformers sits above moe_onnx.torch: only it imports transformers."""
    loaded = loaded_modules("import moe_onnx.torch")
    assert "torch" in loaded and not {m for m in loaded if m.startswith(("transformers", "moe_onnx.transformers"))}


@pytest.mark.parametrize("package", ["custom_ops", "converters", "models", "benchmarks"])
def test_a_folder_cannot_be_imported_a_second_time_under_its_own_name(package):
    result = subprocess.run(
        [sys.executable, "-c", f"import {package}"], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert result.returncode != 0 and f"as 'moe_onnx.{package}'" in result.stderr
