"""One declarative definition per operator.

An :class:`OpDef` names the inputs, outputs and attributes of an operator once, plus two
functions written by the operator's module:

* ``infer(sig)`` states the shape rules and output types over (possibly symbolic) dims. It
  runs inside ``onnx.shape_inference`` (through the derived ``OpSchema``) and, with concrete
  dims, before every kernel call, so the static rules are written exactly once.
* ``kernel(*inputs, **attrs)`` is the numpy math, which checks the value-level rules (counts
  that must sum, indices that must be in range) that no shape can tell.

From these the ONNX schema, the type/shape inference, the validation and (in ``moe_onnx``)
the onnxruntime registration are all derived.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np

from . import dtypes
from .errors import BAD_CONSTRAINT, BAD_DTYPE, MISSING_INPUT, MoeOpError
from .tensor_info import UNKNOWN, Dim, Shape, TensorInfo

if TYPE_CHECKING:
    from .targets import Target

DOMAIN = "cann.moe"
OPSET_VERSION = 1


@dataclass(frozen=True)
class Input:
    name: str
    dtypes: tuple[str, ...]
    doc: str
    ranks: tuple[int, ...] | None = None  # allowed ranks; None = any
    optional: bool = False


@dataclass(frozen=True)
class Output:
    name: str
    dtypes: tuple[str, ...]
    doc: str
    optional: bool = False


@dataclass(frozen=True)
class Attr:
    name: str
    kind: str  # "int", "ints", "float" or "string"
    default: Any  # None with required=False: absent unless given
    doc: str
    choices: tuple | None = None
    required: bool = False


@dataclass(frozen=True)
class DimRule:
    """A shape rule that symbolic dims left undecided, kept so that a runtime can check it
    (the lowering writes each one as a check node). Dims are ints or symbols; ``kind``:

    * ``"equal"`` ``(a, b)``: a == b;
    * ``"multiple"`` ``(a, b)``: a is a whole multiple of b (a == 0 when b == 0);
    * ``"at_most"`` ``(a, b)``: a <= b;
    * ``"quotient_at_most"`` ``(a, b, c)``: a / b <= c (a quotient of 0 when b == 0);
    * ``"equal_min"`` ``(a, b, c)``: a == min(b, c).
    """

    kind: str
    dims: tuple[Dim, ...]
    rule: str


class Signature:
    """One node's view of an operator: its inputs' types/shapes, attributes, wanted outputs.

    ``infer`` functions read it and call :meth:`output`; every rule they check goes through
    :meth:`require`, which raises :class:`MoeOpError` naming the op, the node and the rule.
    A rule on dims that are symbolic is recorded in :attr:`deferred` (:meth:`defer`).
    The opt-in target check (:func:`.targets.check`) also hands over the input arrays it was
    given, so that an op's NPU limits can read values (:meth:`value`); nothing else does.
    """

    def __init__(
        self,
        op: OpDef,
        inputs: dict[str, TensorInfo | None],
        attrs: dict[str, Any],
        wanted: AbstractSet[str] | None,
        node_name: str = "",
        values: dict[str, np.ndarray] | None = None,
    ):
        self.op = op
        self.node_name = node_name
        self._inputs = inputs
        self.attrs = attrs  # every declared attribute, defaults filled in
        self._wanted = wanted
        self.outputs: dict[str, TensorInfo] = {}
        self.deferred: list[DimRule] = []  # rules on symbolic dims, for a run-time check
        self._values = values or {}

    # reading
    def has(self, name: str) -> bool:
        return self._inputs.get(name) is not None

    def input(self, name: str) -> TensorInfo:
        info = self._inputs.get(name)
        return info if info is not None else UNKNOWN

    def dim(self, name: str, axis: int) -> Dim:
        shape = self.input(name).shape
        return None if shape is None or axis >= len(shape) else shape[axis]

    def attr(self, name: str) -> Any:
        return self.attrs[name]

    def value(self, name: str) -> np.ndarray | None:
        """The array of input ``name`` when the target check was given one, else None (shape
        inference, the executors and the kernels never see values here)."""
        return self._values.get(name)

    def wants(self, output: str, default: bool = True) -> bool:
        """Is ``output`` requested? For a bare kernel call the op's natural ``default``."""
        return default if self._wanted is None else output in self._wanted

    # checking
    def fail(self, rule: str, code: int = BAD_CONSTRAINT) -> NoReturn:
        raise MoeOpError(rule, code, op_type=self.op.name, node_name=self.node_name)

    def require(self, ok: bool, rule: str, code: int = BAD_CONSTRAINT) -> None:
        if not ok:
            self.fail(rule, code)

    def same(self, a: Dim, b: Dim, rule: str) -> None:
        """Require two dims to be equal where both are known (deferred where symbolic)."""
        if isinstance(a, int) and isinstance(b, int):
            if a != b:
                self.fail(f"{rule} (got {a} and {b})")
        elif a != b:
            self.defer("equal", (a, b), rule)

    def quotient(self, rows: Dim, by: Dim, rule: str) -> int | None:
        """``rows / by``, required to be whole (``rows == 0`` when ``by == 0``); None (and the
        rule deferred) if either is symbolic."""
        if not (isinstance(rows, int) and isinstance(by, int)):
            self.defer("multiple", (rows, by), rule)
            return None
        if by == 0:
            self.require(rows == 0, f"{rule}: got {rows} rows for 0")
            return 0
        self.require(rows % by == 0, f"{rule}: got {rows} rows for {by}")
        return rows // by

    def defer(self, kind: str, dims: tuple[Dim, ...], rule: str) -> None:
        """Record a rule that symbolic ``dims`` leave undecided (:class:`DimRule`); one with an
        unknown (None) dim is dropped: nothing could check it."""
        if all(d is not None for d in dims):
            self.deferred.append(DimRule(kind, dims, rule))

    def allocates(self, nbytes: Dim, what: str) -> None:
        """Refuse a work buffer of ``nbytes`` (when known) that no machine could hold: sizes an
        attribute asks for are checked before anything is allocated (see :func:`max_bytes`)."""
        if isinstance(nbytes, int) and nbytes > max_bytes():
            self.fail(f"{what} would take {nbytes} bytes, more than the {max_bytes()} bytes allowed ({LIMIT_HELP})")

    # writing
    def output(self, name: str, dtype: str | None, shape: Shape | None) -> None:
        self.outputs[name] = TensorInfo(dtype, None if shape is None else tuple(shape))


@dataclass(eq=False)  # each definition is one operator: compared and hashed by identity
class OpDef:
    """The single source of truth for one operator."""

    name: str
    doc: str
    inputs: Sequence[Input]
    outputs: Sequence[Output]
    attrs: Sequence[Attr]
    infer: Callable[[Signature], None]
    kernel: Callable[..., tuple]
    domain: str = DOMAIN
    #: context objects the kernel needs injected by the runtime (e.g. "communicator")
    needs: tuple[str, ...] = ()
    #: ``(sig, target) -> violations``: the NPU's tiling limits (the opt-in
    #: :func:`moe_onnx.custom_ops.targets.check`); None = no limit recorded
    npu_limits: Callable[[Signature, Target], list[str]] | None = None
    _attr_by_name: dict[str, Attr] = field(init=False, repr=False)

    def __post_init__(self):
        self._attr_by_name = {a.name: a for a in self.attrs}

    def _refuse(self, rule: str, code: int, node_name: str) -> NoReturn:
        raise MoeOpError(rule, code, op_type=self.name, node_name=node_name)

    # attributes
    def bind_attrs(self, given: dict[str, Any], node_name: str = "") -> dict[str, Any]:
        """Fill defaults and check every attribute against its declaration."""
        unknown = set(given) - set(self._attr_by_name)
        if unknown:
            self._refuse(
                f"unknown attribute(s) {sorted(unknown)}; known: {sorted(self._attr_by_name)}",
                BAD_CONSTRAINT,
                node_name,
            )
        bound = {}
        for a in self.attrs:
            value = given.get(a.name, a.default)
            if value is None and a.required:
                self._refuse(f"attribute '{a.name}' is required", MISSING_INPUT, node_name)
            if value is not None:
                value = self._of_kind(a, value, node_name)
            if a.choices is not None and value is not None and value not in a.choices:
                self._refuse(
                    f"attribute '{a.name}' must be one of {list(a.choices)}, got {_short(value)}",
                    BAD_CONSTRAINT,
                    node_name,
                )
            bound[a.name] = value
        return bound

    def _of_kind(self, attr: Attr, value: Any, node_name: str) -> Any:
        """``value`` as its declared kind (ONNX's INT is int64): refused if it is not one.

        A Python (or numpy) bool is an int, ``False`` = 0 and ``True`` = 1 (SPEC-layer 1.18:
        torch_npu passes ``padded_mode=False``); a value that would lose information (0.5 for
        an int, a float for a string) is refused."""
        ok = {
            "int": lambda v: _is_int64(v),
            "ints": lambda v: isinstance(v, (list, tuple)) and all(_is_int64(x) for x in v),
            "float": lambda v: isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool),
            "string": lambda v: isinstance(v, str),
        }[attr.kind]
        if not ok(value):
            self._refuse(
                f"attribute '{attr.name}' must be {_KINDS[attr.kind]}, got {_short(value)} ({type(value).__name__})",
                BAD_CONSTRAINT,
                node_name,
            )
        if attr.kind == "int":
            return int(value)
        if attr.kind == "ints":
            return [int(x) for x in value]
        return float(value) if attr.kind == "float" else value

    # the static rules
    def signature(
        self,
        inputs: Sequence[TensorInfo | None],
        attrs: dict[str, Any],
        wanted: AbstractSet[str] | None = None,
        node_name: str = "",
    ) -> Signature:
        """Check the declared and op-specific static rules; the result holds the outputs."""
        if len(inputs) > len(self.inputs):
            self._refuse(f"takes at most {len(self.inputs)} inputs, got {len(inputs)}", BAD_CONSTRAINT, node_name)
        padded = list(inputs) + [None] * (len(self.inputs) - len(inputs))
        by_name = {}
        for decl, info in zip(self.inputs, padded):
            if info is None:
                if not decl.optional:
                    self._refuse(f"required input '{decl.name}' is missing", MISSING_INPUT, node_name)
            else:
                if info.dtype is not None and info.dtype not in decl.dtypes:
                    self._refuse(
                        f"input '{decl.name}' has dtype {info.dtype}; supported: {', '.join(decl.dtypes)}",
                        BAD_DTYPE,
                        node_name,
                    )
                if decl.ranks is not None and info.shape is not None and len(info.shape) not in decl.ranks:
                    self._refuse(
                        f"input '{decl.name}' must have rank {' or '.join(map(str, decl.ranks))}, "
                        f"got shape {list(info.shape)}",
                        BAD_CONSTRAINT,
                        node_name,
                    )
            by_name[decl.name] = info
        sig = Signature(self, by_name, self.bind_attrs(attrs, node_name), wanted, node_name)
        self.infer(sig)
        sig.allocates(_bytes_of(sig.outputs), f"the outputs {_shapes_of(sig.outputs)}")
        return sig

    # running
    def __call__(
        self,
        *inputs: np.ndarray | None,
        node_name: str = "",
        wanted: AbstractSet[str] | None = None,
        context: dict[str, Any] | None = None,
        **attrs,
    ) -> tuple[np.ndarray | None, ...]:
        """Validate and run the numpy kernel: one entry per declared output (None = absent).

        A :class:`MoeOpError` from the kernel leaves with this op's name and ``node_name``.
        Inputs are taken as C-contiguous native-order arrays (:func:`.dtypes.native`).
        """
        inputs = tuple(None if x is None else dtypes.native(x) for x in inputs)
        sig = self.signature([None if x is None else TensorInfo.of(x) for x in inputs], attrs, wanted, node_name)
        return self.run_inferred(sig, inputs, context)

    def run_inferred(
        self, sig: Signature, inputs: tuple[np.ndarray | None, ...], context: dict[str, Any] | None = None
    ) -> tuple[np.ndarray | None, ...]:
        """The kernel on ``inputs`` (native C-contiguous arrays, :func:`.dtypes.native`) whose
        dtypes and shapes ``sig`` was inferred from (:meth:`signature`): what :meth:`__call__`
        does after inference, for a runtime that keeps each node's signature per input shape."""
        inject = {name: (context or {}).get(name) for name in self.needs}
        try:
            results = self.kernel(*inputs, *[None] * (len(self.inputs) - len(inputs)), **sig.attrs, **inject)
        except MoeOpError as err:
            err.at(self.name, sig.node_name)
            raise
        return self._check_results(sig, results)

    def _check_results(self, sig: Signature, results: tuple) -> tuple:
        """The kernel must return exactly what inference promised: same dtypes, same shapes."""
        out: list[np.ndarray | None] = []
        for decl, value in zip(self.outputs, results):
            promised = sig.outputs.get(decl.name)
            if promised is None:
                out.append(None)
                continue
            got = TensorInfo.of(value)
            concrete = all(isinstance(d, int) for d in promised.shape or ())
            if got.dtype != promised.dtype or (concrete and got.shape != promised.shape):
                raise AssertionError(
                    f"{self.name}: kernel output '{decl.name}' is {got}, inference promised {promised}"
                )
            out.append(value)
        return tuple(out)

    # introspection
    @property
    def input_names(self) -> list[str]:
        return [i.name for i in self.inputs]

    @property
    def output_names(self) -> list[str]:
        return [o.name for o in self.outputs]


class NodeSignatures:
    """One node's signatures by its inputs' dtypes and shapes, for a runtime that calls the node
    again and again (:meth:`OpDef.run_inferred`).

    Inference is a function of the input types and shapes, the attributes and the wanted
    outputs (the last two are fixed per node), so a call on shapes seen before (every decode
    step of a layer) reuses its signature instead of inferring again: the same rules, checked
    once per shape. The output-size limit (:func:`max_bytes`, an environment variable) is
    checked on every call still. At most ``KEEP`` shapes are kept.
    """

    KEEP = 16

    def __init__(self, op: OpDef, attrs: dict[str, Any], wanted: AbstractSet[str] | None, node_name: str):
        self.op, self.attrs, self.wanted, self.node_name = op, attrs, wanted, node_name
        self._known: dict[tuple, tuple[Signature, int | None]] = {}

    def __call__(self, inputs: Sequence[np.ndarray | None]) -> Signature:
        """The signature of a call on ``inputs`` (native arrays); raises MoeOpError as
        :meth:`OpDef.signature` does."""
        key = tuple(None if x is None else (x.dtype, x.shape) for x in inputs)
        known = self._known.get(key)
        if known is None:
            infos = [None if x is None else TensorInfo.of(x) for x in inputs]
            sig = self.op.signature(infos, self.attrs, self.wanted, self.node_name)
            if len(self._known) >= self.KEEP:
                self._known.clear()
            self._known[key] = (sig, _bytes_of(sig.outputs))
            return sig
        sig, nbytes = known
        if nbytes is not None and nbytes > max_bytes():  # the message only when refused
            sig.allocates(nbytes, f"the outputs {_shapes_of(sig.outputs)}")
        return sig


#: the environment variable that sets :func:`max_bytes`
LIMIT_VARIABLE = "MOE_ONNX_MAX_BYTES"
LIMIT_HELP = f"set {LIMIT_VARIABLE} to change the limit"


_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def max_bytes() -> int:
    """The most bytes one op call may ask for, in outputs or in one work buffer its attributes
    size: ``$MOE_ONNX_MAX_BYTES`` if set (bytes, or with a K/M/G/T suffix, powers of 1024),
    else the machine's physical memory. Larger requests are refused with a
    :class:`MoeOpError` naming the size, before any allocation."""
    configured = os.environ.get(LIMIT_VARIABLE, "").strip()
    if configured:
        match = re.fullmatch(r"(\d+)\s*([KMGT]?)i?B?", configured, re.IGNORECASE)
        if match is None:
            raise ValueError(f"{LIMIT_VARIABLE} must be a number of bytes (e.g. 8000000000 or 8G), got {configured!r}")
        return int(match[1]) * _UNITS[match[2].upper()]
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows): 1 TiB
        return 1 << 40


def _bytes_of(outputs: dict[str, TensorInfo]) -> int | None:
    """Bytes of all outputs, when every dim and dtype is known (Python ints: no wrap-around)."""
    total = 0
    for info in outputs.values():
        dims = [d for d in info.shape or () if isinstance(d, int)]
        if info.dtype is None or info.shape is None or len(dims) != len(info.shape):
            return None
        total += math.prod(dims) * dtypes.numpy_dtype(info.dtype).itemsize
    return total


def _shapes_of(outputs: dict[str, TensorInfo]) -> str:
    return ", ".join(f"{name} {list(info.shape or ())} {info.dtype}" for name, info in outputs.items())


_KINDS = {"int": "an integer", "ints": "a list of integers", "float": "a number", "string": "a string"}


def _is_int64(value: Any) -> bool:
    """An int (a bool included: it is 0 or 1) that fits ONNX's int64."""
    return isinstance(value, (int, np.integer, np.bool_)) and -(2**63) <= int(value) < 2**63


def _short(value: Any, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters (an attribute may be megabytes long)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"
