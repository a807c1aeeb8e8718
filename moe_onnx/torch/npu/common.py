"""What every torch_npu alias shares: refusing an argument by name, telling symbolic sizes."""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Callable
from typing import NoReturn

import numpy as np
import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ...custom_ops import BAD_DTYPE, MoeOpError
from ..arrays import tensor_problem
from ..ops import SymbolicAttributeError


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


# --- refusals derived from the signature ------------------------------------------------------
# Every served name's docstring opens with its signature in op-plugin's schema language
# (``torch_npu.npu_x(Tensor x, int? n=None, int[2] r=[]) -> ...``); torch's own schema parser
# reads it, and each argument is checked against its declared type before the function runs
# (SPEC-layer 1.18 amended, "inputs"): a tensor where a tensor goes, on the CPU, of a dtype the
# ops know; an int that is an int (a bool, or a float without a fraction, is one); a list of the
# declared length. A MoeOpError raised further in is re-raised naming the served name.


def _where(name: str, api: str) -> str:
    return name if "." in name else f"{api}.{name}"


def schema_arguments(name: str, function: Callable) -> list:
    """The arguments of the signature ``function``'s docstring opens with (torch's
    ``FunctionSchema`` arguments: ``.name``, ``.type``, ``.N``); defaults are dropped, only the
    types are checked. ``ScalarType`` is read as ``Any`` (a torch dtype or torch_npu's code)."""
    doc = " ".join((function.__doc__ or "").split())
    found = re.search(re.escape(name) + r"\((.*?)\)\s*->", doc)
    if found is None:
        raise ValueError(f"{name}: its docstring does not open with its signature")
    arguments = re.sub(r"=\s*(\[[^\]]*\]|[^,)]*)", "", found.group(1)).replace("ScalarType", "Any")
    return list(torch._C.parse_schema(f"f({arguments}) -> ()").arguments)


def _kind(value) -> str:
    return type(value).__name__


def _int_problem(value) -> str | None:
    if isinstance(value, (bool, int, np.integer, torch.SymInt)):
        return None
    if isinstance(value, (float, np.floating)):
        return None if float(value).is_integer() else f"{value!r} is not a whole number (an int goes here)"
    return f"an int goes here, got {_kind(value)}"


def _problem(rule: tuple[str, str, bool, int | None], value) -> str | None:
    """What is wrong with ``value`` for an argument ``(name, type, optional, N)``, or None."""
    name, text, optional, length = rule
    if value is None:  # (Any: the function decides)
        return None if optional or text == "Any" or name.endswith("dtype") else "None is not a value here (required)"
    if text == "Any" or name.endswith("dtype"):  # dtypes: the function reads them by name
        return None
    if text == "Tensor":
        return tensor_problem(value)
    if text in ("int", "SymInt"):
        return _int_problem(value)
    if text == "bool":
        fine = isinstance(value, (bool, np.bool_)) or (_int_problem(value) is None and value in (0, 1))
        return None if fine else f"a bool goes here, got {value!r}"
    if text == "float":
        fine = isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)
        return None if fine else f"a float goes here, got {_kind(value)}"
    if text == "List[Tensor]" and isinstance(value, torch.Tensor):  # one tensor for a list of one
        return tensor_problem(value)
    if text.startswith("List["):
        if not isinstance(value, (list, tuple, torch.Size)):
            return f"a list goes here, got {_kind(value)}"
        if length is not None and len(value) not in (0, length):
            return f"{length} values (or none) go here, got {len(value)}"
        if text == "List[Tensor]" and not value:
            return "at least one tensor goes here, got an empty list"
        element = tensor_problem if text == "List[Tensor]" else _int_problem
        for i, item in enumerate(value):
            problem = element(item)
            if problem is not None:
                return f"item {i}: {problem}"
    return None


def checked(name: str, function: Callable, api: str = "torch_npu") -> Callable:
    """``function`` refusing, before it runs, an argument its signature's types rule out, with a
    ``MoeOpError`` naming ``api.name``, the argument and the rule; and naming ``api.name`` in
    any ``MoeOpError`` raised further in."""
    signature = inspect.signature(function)
    # by name; where op-plugin's name is not the Python keyword (``self`` is ``input``), by position
    parameters = list(signature.parameters)
    rules = []  # (Python parameter, (name, type, optional, N)): plain data, which torch.compile traces
    for position, argument in enumerate(schema_arguments(name, function)):
        kind = argument.type
        optional = isinstance(kind, torch._C.OptionalType)
        text = str(kind.getElementType() if optional else kind)
        parameter = argument.name if argument.name in parameters else parameters[position]
        rules.append((parameter, (argument.name, text, optional, argument.N)))
    where = _where(name, api)

    @functools.wraps(function)
    def run(*args, **kwargs):
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError as err:
            raise MoeOpError(f"{where}: {err}", BAD_DTYPE) from None
        for parameter, rule in rules:
            if parameter in bound.arguments:
                problem = _problem(rule, bound.arguments[parameter])
                if problem is not None:
                    raise MoeOpError(f"{where}: argument {parameter}: {problem}", BAD_DTYPE)
        try:
            return function(*args, **kwargs)
        except MoeOpError as err:
            if where in str(err):
                raise
            raise MoeOpError(f"{where}: {err.rule}", err.code, op_type=err.op_type, node_name=err.node_name) from err
        except SymbolicAttributeError:
            raise  # the export's own refusal, already naming the op and the attribute
        except (IndexError, TypeError, ValueError, AttributeError) as err:
            # what the types let through and the function's own reading of its arguments cannot
            # take (a 0-dim tensor where a [T, K] one goes: ``expert_idx.shape[1]``)
            raise MoeOpError(
                f"{where}: the arguments do not fit its signature ({type(err).__name__}: {err})", BAD_DTYPE
            ) from err

    return run
