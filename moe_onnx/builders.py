"""Small model builders: one ``cann.moe`` node in a graph, typed from example arrays."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from .custom_ops import DOMAIN, OPS, OPSET_VERSION, TensorInfo, dtypes


def single_node_model(
    op_type: str,
    inputs: dict[str, np.ndarray | None],
    attrs: dict | None = None,
    outputs: list[str] | None = None,
    symbolic: bool = False,
    node_name: str = "node",
    opset: int = 21,
) -> onnx.ModelProto:
    """A model holding one ``cann.moe`` node, its graph outputs typed by shape inference.

    Args:
        op_type: a ``cann.moe`` operator.
        inputs: the op's inputs by declared name (any order); None or left out = absent.
            Graph inputs take the names, dtypes and shapes of these arrays.
        attrs: node attributes.
        outputs: the node's output names ("" = absent); default: the outputs the op gives
            for these inputs and attributes (e.g. no ``permute_topk_weight`` without
            ``expert_topk_weight``).
        symbolic: give the graph inputs symbolic dims named ``<input>_<axis>``.
    """
    op = OPS[op_type]
    unknown = sorted(set(inputs) - set(op.input_names))
    if unknown:
        raise ValueError(f"{op_type} has no input(s) {unknown}; its inputs are {op.input_names}")
    given = {name: array for name, array in inputs.items() if array is not None}
    elements: dict[str, str] = {}  # input name -> element type name
    for name, array in given.items():
        element = dtypes.name_of(array)
        if element is None:
            raise ValueError(f"input '{name}' has dtype {array.dtype}, which this package has no ONNX type for")
        elements[name] = element
    names = [name if name in given else "" for name in op.input_names]
    while names and not names[-1]:
        names.pop()
    if outputs is None:
        infos = [TensorInfo.of(given[name]) if name else None for name in names]
        produced = op.signature(infos, dict(attrs or {}), node_name=node_name).outputs
        outputs = [name if name in produced else "" for name in op.output_names]
        while outputs and not outputs[-1]:
            outputs.pop()
    graph_inputs = []
    for name, array in given.items():
        shape = [f"{name}_{i}" for i in range(array.ndim)] if symbolic else list(array.shape)
        graph_inputs.append(helper.make_tensor_value_info(name, dtypes.onnx_type(elements[name]), shape))
    node = helper.make_node(op_type, names, outputs, domain=DOMAIN, name=node_name, **(attrs or {}))
    graph = helper.make_graph([node], f"{op_type}_graph", graph_inputs, [])
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(DOMAIN, OPSET_VERSION)]
    )
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    by_name = {vi.name: vi for vi in inferred.graph.value_info}
    model.graph.output.extend(by_name[name] for name in outputs if name)
    return model
