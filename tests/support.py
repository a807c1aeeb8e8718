"""Helpers shared by the tests: single-node models and isolated (subprocess) runs."""

from __future__ import annotations

import contextlib
import importlib
import subprocess
import sys
import textwrap

import numpy as np
import onnx
from onnx import TensorProto, helper

import moe_onnx
import moe_onnx.runtime.session  # run_both_executors reads KERNEL_EXECUTORS (the package resolves names lazily)
from moe_onnx.builders import single_node_model

node_model = single_node_model


def inferred_types(model) -> dict[str, tuple[int, list]]:
    """name -> (ONNX elem type, dims) of every value after strict inference; a dim is an int,
    a symbol, or None when unknown (onnx names those unk__N)."""
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    result = {}
    for vi in list(inferred.graph.value_info) + list(inferred.graph.output):
        t = vi.type.tensor_type
        dims = [
            d.dim_value if d.HasField("dim_value") else (d.dim_param if not d.dim_param.startswith("unk__") else None)
            for d in t.shape.dim
        ]
        result[vi.name] = (t.elem_type, [d if d != "" else None for d in dims])
    return result


def run_node(
    op_type: str, inputs: dict[str, np.ndarray | None], attrs: dict | None = None, outputs: list[str] | None = None
) -> list[np.ndarray]:
    """Run one node with both executors (see :func:`run_both_executors`)."""
    model = node_model(op_type, inputs, attrs, outputs)
    return run_both_executors(model, {k: v for k, v in inputs.items() if v is not None})


def run_both_executors(model_or_path, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """Run through ``moe_onnx.InferenceSession`` with every executor; they must agree bit for
    bit, or refuse alike (same exception type and message, which is then raised). Returns the
    split executor's outputs."""
    results = {}
    for executor in moe_onnx.runtime.session.KERNEL_EXECUTORS:
        try:
            results[executor] = moe_onnx.InferenceSession(model_or_path, executor=executor).run(None, feeds)
        except Exception as exc:  # compared below
            results[executor] = exc
    split = results.pop("split")
    for executor, other in results.items():
        if isinstance(split, Exception) or isinstance(other, Exception):
            assert type(split) is type(other) and str(split) == str(other), (
                f"split and {executor} executors differ: {split!r} vs {other!r}"
            )
            continue
        names = [o.name for o in moe_onnx.InferenceSession(model_or_path).get_outputs()]
        for name, a, b in zip(names, split, other):
            assert_same_bits(a, b, f"output '{name}': split and {executor} executors differ")
    if isinstance(split, Exception):
        raise split
    return split


def assert_same_bits(a: np.ndarray, b: np.ndarray, message: str = "") -> None:
    """Same dtype, shape and bytes (NaN payloads and signed zeros included)."""
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape, f"{message}: {a.dtype}{a.shape} vs {b.dtype}{b.shape}"
    assert np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes(), message


def assert_refused(call, code: int, *fragments: str) -> moe_onnx.MoeOpError:
    """``call()`` must raise MoeOpError with CANN ``code`` and every fragment in its message."""
    try:
        call()
    except moe_onnx.MoeOpError as err:
        assert err.code == code, f"code {err.code}, want {code}: {err}"
        for fragment in fragments:
            assert fragment in str(err), f"{fragment!r} not in {str(err)!r}"
        return err
    raise AssertionError("no MoeOpError was raised")


def run_isolated(code: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (so an abort cannot take the test run down)."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=timeout
    )


def all_to_all_model(with_all_to_all: bool = True) -> onnx.ModelProto:
    """``recv = AllToAll(data, send_counts)``; without it the graph just copies ``data``."""
    if with_all_to_all:
        nodes = [
            helper.make_node(
                "AllToAll", ["data", "send_counts"], ["recv", "recv_counts"], domain=moe_onnx.DOMAIN, name="a2a"
            )
        ]
    else:
        nodes = [
            helper.make_node("Identity", ["data"], ["recv"], name="copy"),
            helper.make_node("Identity", ["send_counts"], ["recv_counts"], name="copy_counts"),
        ]
    graph = helper.make_graph(
        nodes,
        "g",
        [
            helper.make_tensor_value_info("data", TensorProto.FLOAT, ["S", 3]),
            helper.make_tensor_value_info("send_counts", TensorProto.INT64, ["N"]),
        ],
        [
            helper.make_tensor_value_info("recv", TensorProto.FLOAT, None),
            helper.make_tensor_value_info("recv_counts", TensorProto.INT64, None),
        ],
    )
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(moe_onnx.DOMAIN, 1)]
    )


@contextlib.contextmanager
def one_product_path():
    """GroupedMatmul's groups of any size through its few-rows kernel (in this process: the
    thread ranks and the single-device session alike)."""
    module = importlib.import_module("moe_onnx.custom_ops.grouped_matmul")
    saved = module.few_rows, module.row_dots
    module.few_rows = lambda rows, dtype, stored_as_rows, weight_elements=0: rows >= 1
    module.row_dots = lambda rows, dtype, stored_as_rows: False
    try:
        yield
    finally:
        module.few_rows, module.row_dots = saved
