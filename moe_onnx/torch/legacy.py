"""Symbolics for the legacy TorchScript exporter, ``torch.onnx.export(..., dynamo=False)``.

:func:`register_legacy_symbolics` registers, with ``torch.onnx.register_custom_op_symbolic``:

* every ``cann_moe`` op (the collectives ``all_to_all`` / ``all_gather`` included) -> its
  ``cann.moe`` node, generated from the OpDef as the dynamo translations are: the same outputs
  named (``shapes.node_outputs``), the same attributes, and output types from the op's
  ``infer`` (a size that depends on values, e.g. the rows an AllToAll receives, is left
  unknown rather than fixed at the traced batch's);
* ``aten::sort`` / ``aten::argsort`` -> exactly torch's stable order (TopK on a unique int64
  key, as the dynamo translation does), for opset 11 and above.

The exporter adds the ``cann.moe`` opset (version 1) to the model itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.onnx import register_custom_op_symbolic

from ..custom_ops import DOMAIN, OPS, OpDef, TensorInfo
from .arrays import TORCH_DTYPES, dtype_name
from .schema import NAMESPACE, snake_case
from .shapes import SIZE_RULES, node_outputs

#: the opset from which the op symbolics are found (the exporter looks down from its target
#: opset to the nearest registration, and up to 9 below it)
OPS_FROM_OPSET = 9
#: the stable sorts need TopK's ``largest`` (opset 11); below it torch's own symbolics stay
SORTS_FROM_OPSET = 11

_ONNX_INT64 = 7  # TensorProto.INT64
_ATTR_SUFFIX = {"int": "i", "ints": "i", "float": "f", "string": "s"}


def register_legacy_symbolics() -> None:
    """Make ``torch.onnx.export(..., dynamo=False)`` export the ``cann_moe`` ops as ``cann.moe``
    nodes and ``torch.sort`` / ``torch.argsort`` in torch's stable order.

    Call it once before exporting (again is harmless). The sort symbolics replace torch's
    own for every overload (``stable=False`` too: a stable order is one of the orders it
    allows) at opset 11 and above; torch's stay below it.
    """
    for name, definition in OPS.items():
        register_custom_op_symbolic(f"{NAMESPACE}::{snake_case(name)}", _node_symbolic(definition), OPS_FROM_OPSET)
    register_custom_op_symbolic("aten::sort", _sort_symbolic, SORTS_FROM_OPSET)
    register_custom_op_symbolic("aten::argsort", _argsort_symbolic, SORTS_FROM_OPSET)


# --- the cann_moe ops ------------------------------------------------------------------


def _is_none(value) -> bool:
    return value is None or value.node().mustBeNone()


def _constant(value, kind: str, what: str) -> Any:
    """A traced non-tensor argument (``kind`` int, ints, float, string) as a Python value; None
    if it is None. ONNX attributes are constants of the graph: anything computed is refused."""
    if _is_none(value):
        return None
    node = value.node()
    if kind == "string" and node.kind() in ("onnx::Constant", "prim::Constant"):  # a string stays a string
        return node.s("value")
    if node.kind() == "onnx::Constant":  # the exporter has turned the traced numbers into tensors
        tensor = node.t("value")
        if kind == "ints":
            return [int(v) for v in tensor.reshape(-1).tolist()]
        return float(tensor) if kind == "float" else int(tensor)
    if node.kind() == "prim::ListConstruct" and kind == "ints":
        return [_constant(v, "int", what) for v in node.inputs()]
    raise TypeError(
        f"{what} is computed in the trace ({node.kind()}); ONNX attributes are constants of the graph: "
        "pass a Python number that does not come from a tensor"
    )


def _dtype(value) -> torch.dtype:
    dtype = value.type().dtype() if isinstance(value.type(), torch._C.TensorType) else None
    if dtype is None:
        raise TypeError(f"the element type of {value.debugName()} is unknown to the exporter")
    return dtype


def _info(value) -> TensorInfo:
    """dtype name and sizes (None where unknown) of a traced tensor."""
    sizes = value.type().varyingSizes()
    return TensorInfo(dtype_name(_dtype(value)), None if sizes is None else tuple(sizes))


def _output_types(definition: OpDef, infos: list[TensorInfo | None], attrs: dict) -> dict[str, Any]:
    """Output name -> its TorchScript type: dtype and sizes from the op's ``infer`` (and
    ``SIZE_RULES`` where infer cannot tell); a symbolic or unknown size is None."""
    sig = definition.signature(infos, attrs)
    sizes = {decl.name: info.shape for decl, info in zip(definition.inputs, infos) if info is not None}
    known = all(shape is not None and all(isinstance(d, int) for d in shape) for shape in sizes.values())
    types = {}
    for name, info in sig.outputs.items():
        assert info.dtype is not None, f"{definition.name}: {name} untyped from typed inputs"
        value_type = torch._C.TensorType.get().with_dtype(TORCH_DTYPES[info.dtype])
        if info.shape is not None:
            shape: list[int | None] = []
            for axis, d in enumerate(info.shape):
                rule = SIZE_RULES.get((definition.name, name, axis))
                if not isinstance(d, int) and rule is not None and known:
                    d = rule(sizes, sig.attrs)
                shape.append(d if isinstance(d, int) else None)
            value_type = value_type.with_sizes(shape)
        types[name] = value_type
    return types


def _absent_input(g):
    """A middle absent optional input (named "" in the node): None typed as an optional tensor."""
    value = g.op("prim::Constant")
    value.setType(torch._C.OptionalType.ofTensor())
    return value


def _empty(g, output_dtype: str):
    """The value standing for an absent optional output (the torch op returns an empty tensor)."""
    return g.op("Constant", value_t=torch.empty(0, dtype=TORCH_DTYPES[output_dtype]))


def _node_symbolic(definition: OpDef) -> Callable:
    count = len(definition.inputs)

    def symbolic(g, *args):
        inputs = [None if _is_none(v) else v for v in args[:count]]
        attrs = {
            a.name: _constant(v, a.kind, f"{definition.name}: attribute {a.name}")
            for a, v in zip(definition.attrs, args[count:])
        }
        infos = [None if v is None else _info(v) for v in inputs]
        present, named, attrs = node_outputs(definition, [None if i is None else i.dtype for i in infos], attrs)
        while inputs and inputs[-1] is None:  # trailing absent inputs: not named at all
            inputs.pop()
        onnx_inputs = [_absent_input(g) if v is None else v for v in inputs]
        onnx_attrs = {
            f"{a.name}_{_ATTR_SUFFIX[a.kind]}": attrs[a.name] for a in definition.attrs if attrs[a.name] is not None
        }
        outputs = g.op(f"{DOMAIN}::{definition.name}", *onnx_inputs, outputs=named, **onnx_attrs)
        outputs = list(outputs) if named > 1 else [outputs]
        types = _output_types(definition, infos, attrs)
        results = []
        for i, (decl, keep) in enumerate(zip(definition.outputs, present)):
            if keep:
                outputs[i].setType(types[decl.name])
                results.append(outputs[i])
            else:
                results.append(_empty(g, decl.dtypes[0]))
        return results[0] if len(results) == 1 else tuple(results)

    symbolic.__name__ = f"cann_moe_{definition.name}"
    return symbolic


# --- stable sorts ----------------------------------------------------------------------


def _sort_arguments(args) -> tuple[int, bool]:
    """(dim, descending) of ``sort``/``argsort(self, dim, descending)`` and of their ``.stable``
    overloads ``(self, *, stable, dim, descending)``."""
    dim, descending = args[-2:] if len(args) == 3 else args[:2]
    return _constant(dim, "int", "sort: dim"), bool(_constant(descending, "int", "sort: descending"))


def _stable_order(g, data, dim: int, descending: bool):
    """Indices that sort ``data`` along ``dim`` stably, as torch does: the dynamo translation's
    keys (``translations._stable_order``) in TorchScript ops of opset 11."""
    rank = data.type().dim()
    if rank is None:
        raise TypeError("sort: the rank of the sorted tensor is unknown to the exporter")
    axis = dim % rank
    length = g.op("Gather", g.op("Shape", data), g.op("Constant", value_t=torch.tensor([axis])), axis_i=0)
    if _dtype(data).is_floating_point:  # TopK's ties go to the lower index (ONNX's contract)
        _, indices = g.op("TopK", data, length, axis_i=axis, largest_i=int(descending), sorted_i=1, outputs=2)
        return indices
    key = g.op("Cast", data, to_i=_ONNX_INT64)
    if descending:
        key = g.op("Neg", key)
    along = [1] * rank
    along[axis] = -1
    zero, one = g.op("Constant", value_t=torch.tensor(0)), g.op("Constant", value_t=torch.tensor(1))
    position = g.op(
        "Reshape", g.op("Range", zero, g.op("Squeeze", length), one), g.op("Constant", value_t=torch.tensor(along))
    )
    unique = g.op("Add", g.op("Mul", key, length), position)
    _, indices = g.op("TopK", unique, length, axis_i=axis, largest_i=0, sorted_i=1, outputs=2)
    return indices


def _sort_symbolic(g, data, *args):
    dim, descending = _sort_arguments(args)
    if data.type().dim() == 0:
        return data, g.op("Constant", value_t=torch.tensor(0))
    indices = _stable_order(g, data, dim, descending)
    return g.op("GatherElements", data, indices, axis_i=dim % data.type().dim()), indices


def _argsort_symbolic(g, data, *args):
    dim, descending = _sort_arguments(args)
    if data.type().dim() == 0:
        return g.op("Constant", value_t=torch.tensor(0))
    return _stable_order(g, data, dim, descending)
