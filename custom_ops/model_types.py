"""Every value's type in a model, as ONNX shape inference and this library's ops tell it."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import onnx
from onnx import helper

from .errors import OpsetImportError
from .opdef import DOMAIN, OPSET_VERSION, OpDef
from .schemas import attribute_value
from .tensor_info import UNKNOWN, TensorInfo

#: initializers up to this size keep their values for inference (shape constants); bigger
#: ones (weights) become typed graph inputs, so inference never copies them
SMALL_INITIALIZER_BYTES = 1 << 16


def graphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    """``graph`` and every subgraph in it (If/Loop/Scan bodies), outer first."""
    yield graph
    for node in graph.node:
        for attr in node.attribute:
            for sub in [attr.g] if attr.HasField("g") else list(attr.graphs):
                yield from graphs(sub)


def value_types(model: onnx.ModelProto, ops: dict[tuple[str, str], OpDef] | None = None) -> dict[str, TensorInfo]:
    """Element type and shape of every value the model names, subgraphs included.

    Inference runs on a skeleton of the model: small initializers keep their values (shape
    constants), bigger ones become typed graph inputs. Ops of ``ops`` (domain, op type) that
    ``onnx.defs`` does not know (``com.microsoft::AllToAll``) type their outputs from their
    OpDef; those types are fed back until inference learns nothing more. ``ops`` defaults to
    every op of this library.
    """
    if ops is None:
        from . import ALL_OPS  # (this module is imported by the package's users, not by it)

        ops = ALL_OPS
    check_opset_import(model)
    skeleton = _skeleton(model)
    foreign = [
        n for n in skeleton.graph.node if (n.domain, n.op_type) in ops and not onnx.defs.has(n.op_type, n.domain)
    ]
    while True:
        inferred = onnx.shape_inference.infer_shapes(skeleton, strict_mode=False)
        types: dict[str, TensorInfo] = {}
        for graph in graphs(inferred.graph):
            for value in list(graph.input) + list(graph.value_info) + list(graph.output):
                types[value.name] = TensorInfo.from_type_proto(value.type)
            for init in graph.initializer:
                types[init.name] = TensorInfo.from_initializer(init)
        for init in model.graph.initializer:  # (the big ones are inputs of the skeleton)
            types[init.name] = TensorInfo.from_initializer(init)
        typed_more = False
        for node in foreign:
            op = ops[(node.domain, node.op_type)]
            infos = [types.get(name) if name else None for name in node.input]
            try:
                sig = op.signature(infos, {a.name: attribute_value(a) for a in node.attribute})
            except Exception:  # noqa: BLE001 - the node's binding reports it, with its name
                continue
            for name, decl in zip(node.output, op.outputs):
                info = sig.outputs.get(decl.name)
                if name and info is not None and info.dtype and types.get(name, UNKNOWN).dtype is None:
                    skeleton.graph.value_info.append(info.value_info(name))
                    typed_more = True
        if not typed_more:
            return types


def check_opset_import(model: onnx.ModelProto) -> None:
    """Refuse, with the fix, a model with ``cann.moe`` nodes that imports no ``cann.moe`` opset
    (onnx's own message, "No opset import for domain", names no fix), and one importing a
    version of the domain other than the one implemented (:class:`OpsetImportError`)."""
    version = next((o.version for o in model.opset_import if o.domain == DOMAIN), None)
    fix = f'model.opset_import.append(onnx.helper.make_opsetid("{DOMAIN}", {OPSET_VERSION}))'
    if version is None:
        node = next((n for g in graphs(model.graph) for n in g.node if n.domain == DOMAIN), None)
        node = node or next((n for f in model.functions for n in f.node if n.domain == DOMAIN), None)
        if node is not None:
            raise OpsetImportError(
                f"node '{node.name}' ({DOMAIN}::{node.op_type}) is in domain {DOMAIN}, which the model does not "
                f"import: add the import, e.g. {fix}"
            )
    elif version != OPSET_VERSION:
        raise OpsetImportError(
            f"the model imports {DOMAIN} version {version}; this library implements version {OPSET_VERSION} "
            f"(the only one): set that import's version to {OPSET_VERSION}"
        )


def _skeleton(model: onnx.ModelProto) -> onnx.ModelProto:
    skeleton = onnx.ModelProto()
    skeleton.ir_version = model.ir_version
    skeleton.opset_import.extend(model.opset_import)
    skeleton.functions.extend(model.functions)
    graph, source = skeleton.graph, model.graph
    graph.name = source.name
    graph.node.extend(source.node)
    graph.input.extend(source.input)
    graph.output.extend(source.output)
    graph.value_info.extend(source.value_info)
    graph.sparse_initializer.extend(source.sparse_initializer)
    declared = {v.name for v in source.input}
    for init in source.initializer:
        if init.data_location != onnx.TensorProto.EXTERNAL and _nbytes(init) <= SMALL_INITIALIZER_BYTES:
            graph.initializer.append(init)
        elif init.name not in declared:
            graph.input.append(helper.make_tensor_value_info(init.name, init.data_type, list(init.dims)))
    return skeleton


def _nbytes(tensor: onnx.TensorProto) -> int:
    return int(np.prod(tensor.dims, dtype=np.int64)) * helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
