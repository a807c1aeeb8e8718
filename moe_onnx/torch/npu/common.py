"""What every torch_npu alias shares: refusing an argument by name, telling symbolic sizes."""

from __future__ import annotations

from typing import NoReturn

import torch

from ...custom_ops import MoeOpError


def refuse(op_type: str, npu_name: str, argument: str, value, why: str) -> NoReturn:
    """Raise the ``MoeOpError`` for an argument the CPU golden does not compute (never ignore it)."""
    raise MoeOpError(
        f"torch_npu.{npu_name}: {argument}={value!r} is not supported: {why}; "
        f"cann.moe::{op_type} computes the default only",
        op_type=op_type,
    )


def is_symbolic(values) -> bool:
    """Does any of ``values`` follow a dynamic size (a SymInt under ``torch.export``)?"""
    return any(isinstance(v, torch.SymInt) for v in values)
