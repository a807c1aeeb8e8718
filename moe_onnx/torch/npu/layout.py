"""torch_npu's layout helpers (SPEC-layer 1.18 amended, "layouts"): ``npu_format_cast``,
``npu_format_cast_``, ``get_npu_format`` and the ``Format`` enum.

An NPU format (FRACTAL_NZ = 29, which Ascend code casts grouped-matmul weights to, NC1HWC0,
...) is a physical layout of the memory: the logical tensor torch code sees, and so every value
an operator computes from it, is the same in every format. On a CPU a cast therefore moves
nothing; the format is only remembered per tensor object, so ``get_npu_format`` answers what
torch_npu would. What it cannot follow: a format belongs to the NPU storage, so torch_npu
reports it on every tensor sharing that storage (``w.data = npu_format_cast(w.data, 29)`` makes
``get_npu_format(w)`` 29); here it belongs to the tensor object the cast returned or changed.
"""

from __future__ import annotations

import enum
import weakref

import torch

from ...custom_ops import BAD_DTYPE, MoeOpError


class Format(enum.IntEnum):
    """torch_npu.Format: the ACL formats torch_npu accepts (op-plugin docs,
    torch_npu-npu_format_cast_.md, the table of torch_npu.Format)."""

    UNDEFINED = -1
    NCHW = 0
    NHWC = 1
    ND = 2
    NC1HWC0 = 3
    FRACTAL_Z = 4
    NC1HWC0_C04 = 12
    HWCN = 16
    NDHWC = 27
    FRACTAL_NZ = 29
    NCDHW = 30
    NDC1HWC0 = 32
    FRACTAL_Z_3D = 33
    NC = 35
    NCL = 47


#: id(tensor) -> (a weak reference to it, the format a cast gave it); tensors never cast have
#: their base format. By identity: a tensor's ``==`` is elementwise.
_FORMATS: dict[int, tuple[weakref.ref, int]] = {}


def _recorded(tensor: torch.Tensor) -> int | None:
    entry = _FORMATS.get(id(tensor))
    return entry[1] if entry is not None and entry[0]() is tensor else None


def _record(tensor: torch.Tensor, fmt: int | None) -> None:
    key = id(tensor)
    if fmt is None:
        _FORMATS.pop(key, None)
    else:

        def forget(_: weakref.ref) -> None:
            _FORMATS.pop(key, None)

        _FORMATS[key] = (weakref.ref(tensor, forget), fmt)


def _format(op_name: str, value) -> int:
    """``value`` (an int or a ``Format``) as a format torch_npu accepts, else refused by name."""
    code = getattr(value, "value", value)
    if isinstance(code, bool) or not isinstance(code, int) or code not in Format._value2member_map_:
        known = ", ".join(f"{f.name} = {f.value}" for f in Format)
        raise MoeOpError(f"torch_npu.{op_name}: acl_format={value!r} is not a torch_npu format ({known})", BAD_DTYPE)
    return int(code)


def _base_format(tensor: torch.Tensor) -> int:
    """The format torch_npu gives a tensor copied to the NPU: NCHW for 4-D, NCDHW for 5-D, ND
    otherwise (the doc's example: ``get_npu_format(torch.rand(2, 3, 4, 5).npu())`` is 0)."""
    return {4: Format.NCHW, 5: Format.NCDHW}.get(tensor.dim(), Format.ND).value


def get_npu_format(input):  # noqa: A002 - torch_npu's keyword
    """torch_npu.get_npu_format(Tensor input) -> int

    Source: Ascend/op-plugin, docs/context/（beta）torch_npu-npu_format_cast_.md (its examples).
    The format the last ``npu_format_cast`` / ``npu_format_cast_`` gave ``input``, else its base
    format (NCHW for 4-D, NCDHW for 5-D, ND otherwise).
    """
    recorded = _recorded(input)
    return _base_format(input) if recorded is None else recorded


def npu_format_cast(input, acl_format, customize_dtype=None):  # noqa: A002 - torch_npu's keyword
    """torch_npu.npu_format_cast(Tensor input, int acl_format, ScalarType? customize_dtype=None) -> Tensor

    Source: Ascend/op-plugin, docs/zh/custom_APIs/torch_npu/（beta）torch_npu-npu_format_cast.md.
    A new tensor with ``input``'s values in ``acl_format`` (any ``torch_npu.Format``, as an int
    or the enum; FRACTAL_NZ = 29 included): on a CPU an alias of ``input`` (``view_as``, so
    autograd passes through) whose format ``get_npu_format`` reports. ``customize_dtype`` (the
    dtype an NPU computes C0 by) is accepted: it too only shapes the physical layout.
    """
    fmt = _format("npu_format_cast", acl_format)
    if fmt == get_npu_format(input):
        return input
    out = input.view_as(input)
    _record(out, fmt)
    return out


def npu_format_cast_(input, src):  # noqa: A002 - torch_npu's keyword
    """torch_npu.npu_format_cast_(Tensor input, Any src) -> Tensor

    Source: Ascend/op-plugin, docs/context/（beta）torch_npu-npu_format_cast_.md. ``src`` is a
    tensor (``input`` takes its format), an int or a ``torch_npu.Format``; ``input`` is
    returned with that format recorded, its values unchanged.
    """
    fmt = get_npu_format(src) if isinstance(src, torch.Tensor) else _format("npu_format_cast_", src)
    _record(input, None if fmt == _base_format(input) else fmt)
    return input


__all__ = ["get_npu_format", "npu_format_cast", "npu_format_cast_"]
