"""Helpers shared by the tests: single-node models and isolated (subprocess) runs."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import onnx

import moe_onnx
from moe_onnx.builders import single_node_model

node_model = single_node_model


def inferred_types(model) -> dict[str, tuple[int, list]]:
    """name -> (ONNX elem type, dims as int or symbol) of every value, after strict inference."""
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    result = {}
    for vi in list(inferred.graph.value_info) + list(inferred.graph.output):
        t = vi.type.tensor_type
        result[vi.name] = (t.elem_type, [d.dim_param or d.dim_value for d in t.shape.dim])
    return result


def run_node(
    op_type: str, inputs: dict[str, np.ndarray | None], attrs: dict | None = None, outputs: list[str] | None = None
) -> list[np.ndarray]:
    """Run one node with both executors (see :func:`run_both_executors`)."""
    model = node_model(op_type, inputs, attrs, outputs)
    return run_both_executors(model, {k: v for k, v in inputs.items() if v is not None})


def run_both_executors(model_or_path, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """Run through ``moe_onnx.InferenceSession`` with the split and the pyop executor; they
    must agree bit for bit. Returns the split executor's outputs."""
    session = moe_onnx.InferenceSession(model_or_path)
    split = session.run(None, feeds)
    pyop = moe_onnx.InferenceSession(model_or_path, executor="pyop").run(None, feeds)
    for name, a, b in zip((o.name for o in session.get_outputs()), split, pyop):
        assert_same_bits(a, b, f"output '{name}': split and pyop executors differ")
    return split


def assert_same_bits(a: np.ndarray, b: np.ndarray, message: str = "") -> None:
    """Same dtype, shape and bytes (NaN payloads and signed zeros included)."""
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape, f"{message}: {a.dtype}{a.shape} vs {b.dtype}{b.shape}"
    assert np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes(), message


def run_isolated(code: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (so an abort cannot take the test run down)."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=timeout
    )


def assert_raises_isolated(setup: str, call: str, code: int, *fragments: str) -> None:
    """In a subprocess, ``call`` must raise MoeOpError with ``code`` and message fragments,
    and the process must then exit normally."""
    program = f"""
import numpy as np, ml_dtypes, moe_onnx
from tests.support import node_model, run_node
{textwrap.dedent(setup)}
try:
    {call}
except moe_onnx.MoeOpError as err:
    print("CODE", err.code)
    print("MESSAGE", err)
else:
    print("NO ERROR")
"""
    result = run_isolated(program)
    assert result.returncode == 0, f"process died ({result.returncode}):\n{result.stderr[-3000:]}"
    assert f"CODE {code}" in result.stdout, result.stdout + result.stderr[-2000:]
    for fragment in fragments:
        assert fragment in result.stdout, f"{fragment!r} not in {result.stdout!r}"
