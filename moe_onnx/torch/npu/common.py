"""What every torch_npu alias shares: refusing an argument by name, telling symbolic sizes."""

from __future__ import annotations

from typing import NoReturn

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ...custom_ops import BAD_DTYPE, MoeOpError


def refuse(op_type: str, npu_name: str, argument: str, value, why: str) -> NoReturn:
    """Raise the ``MoeOpError`` for an argument the CPU golden does not compute (never ignore it),
    with CANN's 161002 (feature or dtype not supported: SPEC-layer's "refuse", the same on every
    target). ``npu_name`` is a torch_npu name, or a dotted name of another API
    (``cann_ops_transformer.x``)."""
    where = npu_name if "." in npu_name else f"torch_npu.{npu_name}"
    raise MoeOpError(
        f"{where}: {argument}={value!r} is not supported: {why}; cann.moe::{op_type} computes the default only",
        BAD_DTYPE,
        op_type=op_type,
    )


def is_symbolic(values) -> bool:
    """Does any of ``values`` follow a dynamic size (a SymInt under ``torch.export``)?"""
    return any(isinstance(v, torch.SymInt) for v in values)


def follows(value, *sizes) -> bool:
    """Is ``value`` a symbolic size (a SymInt under ``torch.export``) known to equal one of
    ``sizes`` for every value of the dynamic dimensions (``T * K`` against ``expert_idx.numel()``)?
    Asked without adding a guard, so the export stays dynamic. Several spellings of one size
    are given because torch.export gives each input's dynamic dimension its own symbol until
    it unifies them after tracing (``x.shape[0]`` and ``expert_idx.shape[0]`` are then unequal)."""
    if not isinstance(value, torch.SymInt):
        return False
    return any(statically_known_true(value == size) for size in sizes)


#: torch_npu's own dtype constants (``torch_npu.hifloat8`` is the int 290, c10_npu::DType) for
#: byte storage, and the element-type names the ONNX ops use for them (SPEC 1.1 tokens_dtype)
NPU_DTYPES = {"hifloat8": 290, "float4_e2m1fn_x2": 296, "float4_e1m2fn_x2": 297}


def stored_dtype_name(op_type: str, npu_name: str, argument: str, value, allowed) -> str | None:
    """The ONNX op's name of the real element type of uint8 storage: ``value`` is None, a torch_npu
    dtype constant (:data:`NPU_DTYPES`), a torch float8 dtype or one of the names ``allowed``."""
    if value is None:
        return None
    by_code = {code: name for name, code in NPU_DTYPES.items()}
    by_torch = {torch.float8_e4m3fn: "float8e4m3fn", torch.float8_e5m2: "float8e5m2"}
    name = by_code.get(value) if isinstance(value, int) else by_torch.get(value, value)
    if name not in allowed:
        refuse(op_type, npu_name, argument, value, f"the storage types moved as bytes are {', '.join(allowed)}")
    return name
