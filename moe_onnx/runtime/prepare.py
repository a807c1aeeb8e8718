"""Rewrite ``cann.moe`` nodes into the PyOp nodes onnxruntime-extensions can run.

Per node: absent optional inputs get an empty placeholder and absent optional outputs a
dummy name (PyOps have fixed arity); attributes, the node name and the real element types
travel in one JSON ``config`` string; each non-native tensor crosses as its bits where only
``cann.moe`` nodes (or, for :class:`moe_onnx.InferenceSession`, the caller) touch it, and
through a ``Cast`` to float32 and back where a native op shares it.
"""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

import onnx
from onnx import helper

from ..converters.model_input import as_proto
from ..custom_ops import DOMAIN, TensorInfo, dtypes
from ..custom_ops.model_types import value_types
from ..custom_ops.tensor_info import UNKNOWN
from .nodes import bind_node, ours, reject_subgraph_ops
from .pyops import NATIVE, bits_carrier, pyop_for

_ABSENT = "moe_onnx::absent"
_CAN_CAST = {"float16", "bfloat16", "float8e4m3fn", "float8e5m2"}


def prepare_for_ort(
    model, *, raw_io: bool = False, context: int = 0, types: dict[str, TensorInfo] | None = None
) -> onnx.ModelProto:
    """The model rewritten for a plain ``onnxruntime.InferenceSession`` (the input is untouched).

    Args:
        model: a model with ``cann.moe`` nodes (or other nodes this library implements,
            such as ``com.microsoft::AllToAll``): an ``onnx.ModelProto``, an
            ``onnx_ir.Model`` or a path.
        raw_io: let graph inputs/outputs of non-native types cross as their bits
            (``uint16``/``uint8``); only :class:`moe_onnx.InferenceSession` feeds that way.
        context: the session context id that kernels report errors to.
        types: :func:`moe_onnx.custom_ops.model_types.value_types` of ``model``, if the caller has it.
    Returns:
        A new model; run it with options from :func:`moe_onnx.session_options`, made after
        this call.
    """
    prepared = onnx.ModelProto()
    prepared.CopyFrom(as_proto(model))
    graph = prepared.graph
    reject_subgraph_ops(graph)
    if not any(ours(n) for n in graph.node):
        return prepared
    types = value_types(prepared) if types is None else types
    plan = _Plan(graph, types, raw_io)

    new_nodes: list[onnx.NodeProto] = []
    for index, node in enumerate(graph.node):
        if not ours(node):
            new_nodes.append(node)
            continue
        new_nodes.extend(plan.rewrite(node, index, context))
    del graph.node[:]
    graph.node.extend(new_nodes)
    plan.finish(prepared)
    return prepared


class _Plan:
    """Carrier decisions for one graph, and the nodes/initializers the rewrite adds."""

    def __init__(self, graph: onnx.GraphProto, types: dict[str, TensorInfo], raw_io: bool):
        self.graph = graph
        self.types = types
        self.graph_inputs = {vi.name for vi in graph.input}
        self.graph_outputs = {vi.name for vi in graph.output}
        self.initializers = {init.name for init in graph.initializer}
        self.consumers = defaultdict(list)
        self.producer = {}
        for node in graph.node:
            for name in node.input:
                if name:
                    self.consumers[name].append(node)
            for name in node.output:
                if name:
                    self.producer[name] = node
        self.raw_io = raw_io
        self.cast_in: dict[str, str] = {}  # tensor -> its float32 copy
        self.bits_io: dict[str, str] = {}  # graph input/output -> real dtype crossing as bits
        self.need_absent = False

    def dtype(self, name: str, node: onnx.NodeProto) -> str:
        dtype = self.types.get(name, UNKNOWN).dtype
        if dtype is None:
            raise ValueError(
                f"cannot tell the element type of '{name}' feeding {node.op_type} "
                f"node '{node.name}'; give it a type in the graph"
            )
        return dtype

    def crosses_as_bits(self, name: str) -> bool:
        """Can the bits of this non-native tensor cross unchanged? (see module doc)"""
        if not all(ours(c) for c in self.consumers[name]):
            return False
        if name in self.graph_outputs and not self.raw_io:
            return False
        producer = self.producer.get(name)
        if producer is not None:
            return ours(producer)
        return name in self.graph_inputs and name not in self.initializers and self.raw_io

    def carrier(self, name: str, dtype: str) -> str:
        if dtype in NATIVE:
            return dtype
        if self.crosses_as_bits(name):
            if name in self.graph_inputs or name in self.graph_outputs:
                self.bits_io[name] = dtype
            return bits_carrier(dtype)
        if dtype not in _CAN_CAST:
            raise ValueError(
                f"'{name}' is {dtype}, which onnxruntime 1.32 cannot Cast; it may "
                "only flow between cann.moe nodes and the graph boundary"
            )
        return "float32"

    def rewrite(self, node: onnx.NodeProto, index: int, context: int) -> list[onnx.NodeProto]:
        bound = bind_node(node, index, self.types)
        op, node_name, attrs, sig = bound.op, bound.name, bound.attrs, bound.sig

        before, after = [], []
        inputs: list[str] = []
        in_carriers: list[str] = []
        in_dtypes: list[str | None] = []
        for name in bound.inputs:
            if name is None:
                self.need_absent = True
                inputs.append(_ABSENT)
                in_carriers.append("float32")
                in_dtypes.append(None)
                continue
            dtype = self.dtype(name, node)
            carrier = self.carrier(name, dtype)
            if carrier == "float32" and dtype != "float32":
                if name not in self.cast_in:
                    self.cast_in[name] = f"{name}::float32"
                    before.append(
                        helper.make_node(
                            "Cast",
                            [name],
                            [self.cast_in[name]],
                            name=f"{node_name}::cast_{name}",
                            to=onnx.TensorProto.FLOAT,
                        )
                    )
                name = self.cast_in[name]
            inputs.append(name)
            in_carriers.append(carrier)
            in_dtypes.append(dtype)

        outputs: list[str] = []
        out_carriers: list[str] = []
        out_dtypes: list[str | None] = []
        out_ranks: list[int] = []
        for decl, name in zip(op.outputs, bound.outputs):
            info = sig.outputs.get(decl.name)
            if not name or info is None:
                outputs.append(f"{node_name}::unused::{decl.name}")
                out_carriers.append("float32")
                out_dtypes.append(None)
                out_ranks.append(1)
                continue
            # every input's dtype is known (self.dtype); each output has an input's dtype or a fixed one
            assert info.dtype is not None
            dtype = info.dtype
            out_ranks.append(1 if info.shape is None else len(info.shape))
            carrier = self.carrier(name, dtype)
            if carrier == "float32" and dtype != "float32":
                after.append(_cast_back(f"{name}::float32", name, dtype, node_name))
                name = f"{name}::float32"
            outputs.append(name)
            out_carriers.append(carrier)
            out_dtypes.append(dtype)

        domain, op_type = pyop_for(op, in_carriers, out_carriers)
        config = json.dumps(
            {
                "node": node_name,
                "context": context,
                "attrs": attrs,
                "inputs": in_dtypes,
                "outputs": out_dtypes,
                "output_ranks": out_ranks,
                "output_names": op.output_names,
            },
            separators=(",", ":"),
        )
        pyop = helper.make_node(op_type, inputs, outputs, name=node_name, domain=domain, config=config)
        return before + [pyop] + after

    def finish(self, model: onnx.ModelProto) -> None:
        graph = model.graph
        if self.need_absent:
            graph.initializer.append(helper.make_tensor(_ABSENT, onnx.TensorProto.FLOAT, [0], []))
        for vi in list(graph.input) + list(graph.output):
            if vi.name in self.bits_io:
                vi.type.tensor_type.elem_type = dtypes.onnx_type(bits_carrier(self.bits_io[vi.name]))
        # drop annotations that may now disagree with the carriers
        keep = [vi for vi in graph.value_info if self.types.get(vi.name, UNKNOWN).dtype in NATIVE]
        del graph.value_info[:]
        graph.value_info.extend(keep)
        domains = {n.domain for n in graph.node if n.domain not in ("", "ai.onnx", DOMAIN)}
        opsets = [o for o in model.opset_import if o.domain != DOMAIN]
        known = {o.domain for o in opsets}
        opsets += [helper.make_opsetid(d, 1) for d in sorted(domains - known)]
        del model.opset_import[:]
        model.opset_import.extend(opsets)


def _cast_back(source: str, target: str, dtype: str, node_name: str) -> onnx.NodeProto:
    extra: dict[str, Any] = {"saturate": 0} if dtype.startswith("float8") else {}  # keep inf as inf
    return helper.make_node(
        "Cast", [source], [target], name=f"{node_name}::cast_{target}", to=dtypes.onnx_type(dtype), **extra
    )
