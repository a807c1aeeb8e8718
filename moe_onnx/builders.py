"""Small model builders: one ``cann.moe`` node in a graph, typed from example arrays."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from .custom_ops import DOMAIN, OPS, OPSET_VERSION, dtypes


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
        inputs: the op's inputs by declared name, in declaration order; None = absent.
            Graph inputs take the names, dtypes and shapes of these arrays.
        attrs: node attributes.
        outputs: the node's output names ("" = absent); default: every declared output.
        symbolic: give the graph inputs symbolic dims named ``<input>_<axis>``.
    """
    op = OPS[op_type]
    names = [name if inputs.get(name) is not None else "" for name in op.input_names[: len(inputs)]]
    while names and not names[-1]:
        names.pop()
    outputs = list(op.output_names) if outputs is None else outputs
    graph_inputs = []
    for name, array in inputs.items():
        if array is None:
            continue
        shape = [f"{name}_{i}" for i in range(array.ndim)] if symbolic else list(array.shape)
        dtype = dtypes.name_of(array) or str(array.dtype)  # one this package lacks fails in onnx_type
        graph_inputs.append(helper.make_tensor_value_info(name, dtypes.onnx_type(dtype), shape))
    node = helper.make_node(op_type, names, outputs, domain=DOMAIN, name=node_name, **(attrs or {}))
    graph = helper.make_graph([node], f"{op_type}_graph", graph_inputs, [])
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(DOMAIN, OPSET_VERSION)]
    )
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    by_name = {vi.name: vi for vi in inferred.graph.value_info}
    model.graph.output.extend(by_name[name] for name in outputs if name)
    return model
