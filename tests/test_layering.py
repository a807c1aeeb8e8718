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
    banned = ("onnxruntime", "moe_onnx.runtime.session", "numba", "torch", "transformers", "moe_onnx.transformers")
    assert not {m for m in loaded if m.startswith(banned)}
    assert "moe_onnx.custom_ops" in loaded  # (and the schemas are registered with it)


def test_the_front_door_loads_the_session_when_asked():
    assert not {"onnxruntime", "transformers"} & loaded_modules("import moe_onnx")
    assert "moe_onnx.runtime.session" in loaded_modules("import moe_onnx; moe_onnx.InferenceSession")


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


#: moe_onnx's subpackages, bottom to top: a module imports only from its own layer or below
LAYERS = ["custom_ops", "converters", "runtime", "ranks", "commands"]


def _imported_layers(path: str, package: list[str]) -> set[str]:
    """The moe_onnx subpackages a module imports (relative or absolute, at any depth in the file)."""
    import ast

    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = [*base, *(node.module.split(".") if node.module else [])]
            names = [".".join([*module, alias.name]) for alias in node.names] if node.level else [".".join(module)]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "moe_onnx" and len(parts) > 1 and parts[1] in LAYERS:
                found.add(parts[1])
    return found


@pytest.mark.parametrize("layer", ["runtime", "ranks", "commands"])
def test_the_front_doors_subpackages_import_only_downwards(layer):
    """runtime/, ranks/, commands/ (docs/architecture.md): commands -> ranks -> runtime, never up."""
    folder = os.path.join(ROOT, "moe_onnx", layer)
    modules = sorted(f for f in os.listdir(folder) if f.endswith(".py"))
    assert modules
    above = set(LAYERS[LAYERS.index(layer) + 1 :])
    for module in modules:
        upward = _imported_layers(os.path.join(folder, module), ["moe_onnx", layer]) & above
        assert not upward, f"moe_onnx/{layer}/{module} imports {sorted(upward)}, a layer above it"


def test_the_package_top_level_holds_only_shared_modules():
    """The flat files are grouped: what stays at moe_onnx/ is what every layer shares."""
    flat = sorted(f for f in os.listdir(os.path.join(ROOT, "moe_onnx")) if f.endswith(".py"))
    assert flat == ["__init__.py", "builders.py", "errors.py", "interrupts.py"]
