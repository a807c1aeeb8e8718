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

from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NoReturn

import numpy as np

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


class Signature:
    """One node's view of an operator: its inputs' types/shapes, attributes, wanted outputs.

    ``infer`` functions read it and call :meth:`output`; every rule they check goes through
    :meth:`require`, which raises :class:`MoeOpError` naming the op, the node and the rule.
    """

    def __init__(
        self,
        op: OpDef,
        inputs: dict[str, TensorInfo | None],
        attrs: dict[str, Any],
        wanted: AbstractSet[str] | None,
        node_name: str = "",
    ):
        self.op = op
        self.node_name = node_name
        self._inputs = inputs
        self.attrs = attrs  # every declared attribute, defaults filled in
        self._wanted = wanted
        self.outputs: dict[str, TensorInfo] = {}

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
        """Require two dims to be equal where both are known."""
        if isinstance(a, int) and isinstance(b, int) and a != b:
            self.fail(f"{rule} (got {a} and {b})")

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
            if a.choices is not None and value is not None and value not in a.choices:
                self._refuse(
                    f"attribute '{a.name}' must be one of {list(a.choices)}, got {value!r}", BAD_CONSTRAINT, node_name
                )
            bound[a.name] = value
        return bound

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
        """
        sig = self.signature([None if x is None else TensorInfo.of(x) for x in inputs], attrs, wanted, node_name)
        inject = {name: (context or {}).get(name) for name in self.needs}
        try:
            results = self.kernel(*inputs, *[None] * (len(self.inputs) - len(inputs)), **sig.attrs, **inject)
        except MoeOpError as err:
            err.at(self.name, node_name)
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
