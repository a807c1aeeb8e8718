"""ONNX translations for ``torch.onnx.export(..., dynamo=True, custom_translation_table=...)``.

* every ``cann_moe`` op -> its ``cann.moe`` node, generated from the OpDef;
* torch's functional collectives (what ``torch.export`` makes of ``torch.distributed`` calls):
  ``all_to_all_single`` -> ``cann.moe::AllToAll``, ``all_gather_into_tensor`` ->
  ``cann.moe::AllGather`` + Reshape, ``wait_tensor`` -> Identity;
* ``aten.sort.stable`` / ``aten.argsort.stable``: exactly torch's stable order;
* ``aten.remainder.Scalar`` whose divisor is a symbolic size (a dynamic token count).

The functions are traced by the exporter: they call ONNX ops through onnxscript opsets and
return ``onnx_ir`` values.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import onnx_ir as ir
import onnxscript
import torch
from onnxscript.values import Opset

from ..custom_ops import DOMAIN, OPS, OPSET_VERSION, OpDef, dtypes
from .ops import OVERLOADS
from .shapes import node_outputs

# Any: the traced functions pass onnx_ir values where onnxscript's typed opsets expect protos
op: Any = onnxscript.opset18
CANN: Any = Opset(DOMAIN, OPSET_VERSION)


def _dtype_name(value: ir.Value | None) -> str | None:
    return None if value is None or value.dtype is None else dtypes.name_of_onnx(int(value.dtype))


def _empty(output_dtype: str) -> Any:
    """The value standing for an absent optional output (the torch op returns an empty tensor)."""
    return op.Constant(value=ir.tensor(np.zeros(0, dtypes.numpy_dtype(output_dtype))))


def _node_translation(definition: OpDef) -> Callable:
    def translate(*args, **kwargs):
        inputs = list(args) + [None] * (len(definition.inputs) - len(args))
        present, named, attrs = node_outputs(definition, [_dtype_name(v) for v in inputs], kwargs)
        onnx_attrs = {k: v for k, v in attrs.items() if v is not None}
        outputs = getattr(CANN, definition.name)(*inputs, **onnx_attrs)
        outputs = list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]
        outputs[0].producer().resize_outputs(named)  # trailing absent outputs: not named at all
        results = [out if keep else _empty(d.dtypes[0]) for out, d, keep in zip(outputs, definition.outputs, present)]
        return results[0] if len(results) == 1 else tuple(results)

    translate.__name__ = f"cann_moe_{definition.name}"
    return translate


# --- torch's functional collectives ----------------------------------------------------


def _int64_vector(sizes) -> Any:
    """``[N]`` int64 from a list of Python ints and symbolic (ONNX scalar) sizes."""
    parts = [
        op.Constant(value_ints=[s]) if isinstance(s, int) else op.Reshape(op.Cast(s, to=ir.DataType.INT64), [1])
        for s in sizes
    ]
    return op.Concat(*parts, axis=0)


def _process_group(group_name):
    if isinstance(group_name, str):
        return torch.distributed.distributed_c10d._resolve_process_group(group_name)  # type: ignore[arg-type]
    return group_name


def _group_attrs(group_name) -> dict:
    """``{"group_ranks": [global ranks]}`` for a group smaller than the world (DeepSpeed's
    expert-parallel groups, megatron-core's ETP group), else nothing: the node runs on the
    whole world, as every cann.moe collective without the attribute."""
    ranks = torch.distributed.get_process_group_ranks(_process_group(group_name))
    return {} if ranks == list(range(torch.distributed.get_world_size())) else {"group_ranks": ranks}


def c10d_all_to_all_single(data, output_split_sizes, input_split_sizes, group_name):
    """``all_to_all_single`` -> ``cann.moe::AllToAll`` on the same ranks; equal splits when no
    sizes are given. The output split sizes are not needed: AllToAll exchanges the counts itself."""
    if len(input_split_sizes):
        send_counts = _int64_vector(input_split_sizes)
    else:
        size = _process_group(group_name).size()
        rows = op.Shape(data, start=0, end=1)
        send_counts = op.Expand(op.Div(rows, op.Constant(value_ints=[size])), op.Constant(value_ints=[size]))
    recv_data, _ = CANN.AllToAll(data, send_counts, **_group_attrs(group_name))
    return recv_data


def c10d_all_gather_into_tensor(data, group_size, group_name):
    """``all_gather_into_tensor`` concatenates along dim 0: AllGather (on the same ranks)
    stacks, then Reshape."""
    stacked = CANN.AllGather(data, **_group_attrs(group_name))
    shape = op.Concat(op.Constant(value_ints=[-1]), op.Shape(data, start=1), axis=0)
    return op.Reshape(stacked, shape)


def c10d_wait_tensor(data):
    return op.Identity(data)


# --- stable sort -----------------------------------------------------------------------


def _stable_order(data, dim: int, descending: bool):
    """Indices that sort ``data`` along ``dim`` stably (ties keep their order), as torch does.

    Integers and bools: TopK on the unique int64 key ``value * n + position`` (for int64
    inputs the key must not overflow: ``|value| * n < 2**63``). Floats: TopK, whose ties go
    to the lower index (ONNX's TopK contract, which onnxruntime keeps).
    """
    rank = len(data.shape)
    axis = dim % rank
    length = op.Shape(data, start=axis, end=axis + 1)
    if ir.DataType(data.dtype).is_floating_point():
        _, indices = op.TopK(data, length, axis=axis, largest=int(descending), sorted=1)
        return indices
    key = op.Cast(data, to=ir.DataType.INT64)
    if descending:
        key = op.Neg(key)
    along = [1] * rank
    along[axis] = -1
    position = op.Reshape(op.Range(op.Constant(value_int=0), op.Squeeze(length), op.Constant(value_int=1)), along)
    _, indices = op.TopK(op.Add(op.Mul(key, length), position), length, axis=axis, largest=0, sorted=1)
    return indices


def aten_sort_stable(data, stable=None, dim: int = -1, descending: bool = False):
    if len(data.shape) == 0:
        return op.Identity(data), op.Constant(value_int=0)
    indices = _stable_order(data, dim, descending)
    return op.GatherElements(data, indices, axis=dim % len(data.shape)), indices


def aten_argsort_stable(data, stable: bool = True, dim: int = -1, descending: bool = False):
    if len(data.shape) == 0:
        return op.Constant(value_int=0)
    return _stable_order(data, dim, descending)


# --- remainder by a symbolic size ------------------------------------------------------


def aten_remainder_scalar(data, other):
    """``data % other`` with torch's sign rule (that of the divisor); ``other`` may be a
    symbolic size, which torchlib's translation cannot take."""
    dtype = ir.DataType(data.dtype)
    if isinstance(other, ir.Value):
        divisor = op.Cast(other, to=dtype)
    else:
        divisor = op.Constant(value=ir.tensor(np.array(other, dtype.numpy())))
    if dtype.is_integer():
        return op.Mod(data, divisor, fmod=0)
    return op.Sub(data, op.Mul(op.Floor(op.Div(data, divisor)), divisor))


def translation_table() -> dict:
    """``{torch op: ONNX translation}`` for ``torch.onnx.export(..., custom_translation_table=...)``."""
    table = {OVERLOADS[name]: _node_translation(definition) for name, definition in OPS.items()}
    table.update(
        {
            torch.ops._c10d_functional.all_to_all_single.default: c10d_all_to_all_single,
            torch.ops._c10d_functional.all_gather_into_tensor.default: c10d_all_gather_into_tensor,
            torch.ops._c10d_functional.wait_tensor.default: c10d_wait_tensor,
            torch.ops.aten.sort.stable: aten_sort_stable,
            torch.ops.aten.argsort.stable: aten_argsort_stable,
            torch.ops.aten.remainder.Scalar: aten_remainder_scalar,
        }
    )
    return table
