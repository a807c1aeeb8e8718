"""A constant GroupedMatmul weight as one initializer per expert, for inline lowering.

A ``[E, K, N]`` (or ``[E, N, K]``) float32 initializer read by ``GroupedMatmul`` (group_type
0) becomes E initializers of one matrix each, ``<weight>/expert<e>``, which the lowered body
multiplies by constant ``Gemm`` nodes: onnxruntime packs each once, when the session starts,
and nothing is copied from the weights per call (standard ONNX has no op that multiplies by a
slice of a tensor in place; the ``Loop`` form gathers each hit expert's weight first).
Tensors in external data stay there: each expert's initializer points at its bytes in the
same file. The original initializer is dropped once nothing reads it.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, numpy_helper

from .lowering import Specialisation
from .lowering.builder import expert_weight

#: the op whose constant weight is split, and the group type that reads one matrix per expert
_OP, _SPLIT_ROWS = "GroupedMatmul", 0


class ExpertWeights:
    """The per-expert initializers of a model's constant GroupedMatmul weights, made on demand."""

    def __init__(self, model: onnx.ModelProto, names):
        """``model``: the pass's copy, changed in place; ``names``: its ``lower.NameSource``
        (fresh prefixes for the experts' initializers)."""
        self.graph = model.graph
        inputs = {value.name for value in self.graph.input}  # an input may override its initializer
        self.constants = {t.name: t for t in self.graph.initializer if t.name not in inputs}
        self.names = names
        self.split: dict[str, list[str]] = {}

    def shape(self, node: onnx.NodeProto, spec: Specialisation) -> tuple[int, ...]:
        """The weight's shape ``[E, ., .]`` if ``node`` (of the main graph) reads a constant
        float32 weight that can be split per expert; else ``()``."""
        if node.op_type != _OP or spec.attr("group_type") != _SPLIT_ROWS or spec.dtype("x") != "float32":
            return ()
        weight = self.constants.get(node.input[1]) if len(node.input) > 1 else None
        if weight is None or weight.data_type != TensorProto.FLOAT or len(weight.dims) != 3 or weight.dims[0] < 1:
            return ()
        return tuple(int(d) for d in weight.dims)

    def binding(self, node: onnx.NodeProto, experts: int) -> dict[str, str]:
        """``{formal name: initializer}`` of the experts' matrices of ``node``'s weight."""
        name = node.input[1]
        if name not in self.split:
            prefix = self.names.prefix(name)
            self.split[name] = [f"{prefix}expert{e}" for e in range(experts)]
            add_per_expert(self.graph, self.constants[name], self.split[name])
        return {expert_weight(e): initializer for e, initializer in enumerate(self.split[name])}

    def drop_unread(self, read: set[str]) -> None:
        """Remove the split weights that no node or graph output reads any more."""
        unread = set(self.split) - read - {value.name for value in self.graph.output}
        for at in reversed(range(len(self.graph.initializer))):  # in place: no tensor is copied
            if self.graph.initializer[at].name in unread:
                del self.graph.initializer[at]


def add_per_expert(graph: onnx.GraphProto, weight: TensorProto, names: list[str]) -> None:
    """Add ``weight[e]`` to ``graph`` as an initializer named ``names[e]`` for each e: in
    external data, a reference to its bytes in the same file (nothing read); otherwise a copy
    of its bytes (each copied once: 1.2 GB took ~1 s)."""
    matrix = [int(d) for d in weight.dims[1:]]
    size = 4 * matrix[0] * matrix[1]  # float32, little-endian in raw data and external files
    external = weight.data_location == TensorProto.EXTERNAL
    if external:
        # (a checksum of the whole tensor would not hold for a part)
        entries = {entry.key: entry.value for entry in weight.external_data if entry.key != "checksum"}
        start = int(entries.get("offset", 0))
    else:
        raw = weight.raw_data if weight.HasField("raw_data") else numpy_helper.to_array(weight).astype("<f4").tobytes()
    for e, name in enumerate(names):
        part = graph.initializer.add(name=name, data_type=weight.data_type, dims=matrix)
        if external:
            part.data_location = TensorProto.EXTERNAL
            for key, value in {**entries, "offset": str(start + e * size), "length": str(size)}.items():
                part.external_data.add(key=key, value=value)
        else:
            part.raw_data = raw[e * size : (e + 1) * size]
