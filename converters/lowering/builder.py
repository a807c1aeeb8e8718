"""Building a function body in standard ONNX ops, and what a body may know of its node.

A lowering is a function ``body(b: Body, node: Specialisation) -> None``: it reads the
node's attributes, input dtypes and wanted outputs from ``node``, appends standard ops with
``b.<OpType>(*inputs, **attributes)`` (each call returns its output's name), and binds each
wanted output with ``b.output(name, value)``. The formal inputs and outputs of the body are
the op's declared input and output names, so a body refers to an input by its name.

Index tensors inside bodies are int64 (what Gather, TopK, NonZero and the Scatter ops use);
the op's int32 index outputs are cast once at the end.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

from moe_onnx.custom_ops import DOMAIN, MoeOpError, OpDef, TensorInfo, dtypes
from moe_onnx.custom_ops.errors import BAD_DTYPE
from moe_onnx.custom_ops.opdef import DimRule

INT64 = TensorProto.INT64
INT32 = TensorProto.INT32
FLOAT = TensorProto.FLOAT
BOOL = TensorProto.BOOL
#: the lowest default-domain opset a body is written for: ReduceMax/ReduceMin take their axes
#: as an input from opset 18, and ScatterND/ScatterElements reduce from opset 16
MIN_OPSET = 18
#: an input whose declared dtypes all lie here holds counts, indices or a map, never rows
#: (tokens may be int8 too, but their declared dtypes include floats)
_INDEX_DTYPES = {"int32", "int64", "bool", "int8"}


class LoweringError(MoeOpError):
    """A node that cannot be written in standard ONNX ops that onnxruntime's CPU provider runs."""

    def __init__(self, op_type: str, rule: str, node_name: str = ""):
        super().__init__(f"cannot lower: {rule}", BAD_DTYPE, op_type=op_type, node_name=node_name)


@dataclass(frozen=True)
class Specialisation:
    """Everything a body depends on: the op, its attributes, its inputs' dtypes and ranks, the
    wanted outputs.

    Nodes with equal specialisations share one function; :attr:`overload` names it.
    """

    op: OpDef
    attrs: tuple[tuple[str, Any], ...]  # every declared attribute, defaults filled in
    input_dtypes: tuple[str | None, ...]  # per declared input; None = absent
    wanted: tuple[bool, ...]  # per declared output
    opset: int  # the model's default-domain opset
    input_ranks: tuple[int | None, ...] = ()  # per declared input; None = absent or unknown
    node_name: str = ""  # for error messages only: not part of the identity
    #: the shape ``[E, ., .]`` of a constant weight that the body reads as E initializers, one
    #: per expert (:func:`expert_weight`), not as its ``weight`` input: inline lowering only
    #: (converters/expert_weights.py); empty when the weight is read as the input
    expert_weights: tuple[int, ...] = ()

    @property
    def key(self) -> tuple:
        """The identity: two nodes with equal keys share a function (OpDef is not hashable)."""
        return (
            self.op.name,
            self.attrs,
            self.input_dtypes,
            self.input_ranks,
            self.wanted,
            self.opset,
            self.expert_weights,
        )

    def __hash__(self) -> int:
        return hash(self.key)

    def __eq__(self, other) -> bool:
        return isinstance(other, Specialisation) and self.key == other.key

    @property
    def overload(self) -> str:
        """``<attr>=<value>,...;<input dtypes, '-' if absent>;<input ranks>;<outputs, 1 named / 0 not>``.

        e.g. ``expert_token_num_type=1,idx_type=0;int8,int32,float32,-;2,2,1,-;11110``.
        Attributes that are absent (no default) are left out; list values are joined with
        ``x``; an absent input or unknown rank is ``-``.
        """
        attrs = ",".join(f"{k}={_text(v)}" for k, v in self.attrs if v is not None)
        ins = ",".join(d or "-" for d in self.input_dtypes)
        ranks = ",".join("-" if r is None else str(r) for r in self.input_ranks)
        outs = "".join("1" if w else "0" for w in self.wanted)
        return f"{attrs};{ins};{ranks};{outs}"

    def dim_rules(self) -> list[DimRule]:
        """The op's shape rules over the inputs' dims, none of them known: the rules a body
        checks at run time (a symbolic dim is not decided when lowering). A dim is named
        ``<input>#<axis>`` (read back by :meth:`Body._dim_value`)."""
        infos = [
            None if d is None else TensorInfo(d, None if r is None else tuple(f"{i.name}#{a}" for a in range(r)))
            for i, d, r in zip(self.op.inputs, self.input_dtypes, self.input_ranks)
        ]
        if self.expert_weights:  # known: the rules over them held when the node was specialised
            at = self.op.input_names.index("weight")
            infos[at] = TensorInfo(self.input_dtypes[at], self.expert_weights)
        wanted = {o for o, w in zip(self.op.output_names, self.wanted) if w}
        return self.op.signature(infos, dict(self.attrs), wanted, node_name=self.node_name).deferred

    def attr(self, name: str) -> Any:
        return dict(self.attrs)[name]

    def has(self, name: str) -> bool:
        return self.input_dtypes[self.op.input_names.index(name)] is not None

    def dtype(self, name: str) -> str:
        """The element type of input ``name``, which must be present."""
        dtype = self.input_dtypes[self.op.input_names.index(name)]
        if dtype is None:
            raise self.refuse(f"input '{name}' is absent")
        return dtype

    def wants(self, output: str) -> bool:
        return self.wanted[self.op.output_names.index(output)]

    def refuse(self, rule: str) -> LoweringError:
        return LoweringError(self.op.name, rule, self.node_name)


def expert_weight(e: int) -> str:
    """The name by which a body reads expert ``e``'s weight matrix when
    :attr:`Specialisation.expert_weights` is set (bound to an initializer when inlined)."""
    return f"weight.{e}"


def _text(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return "x".join(map(str, value))
    return str(value)


class Body:
    """A function body under construction. ``b.Gather(x, index, axis=0)`` appends a
    ``Gather`` node and returns the name of its output (``outputs=n`` returns n names)."""

    def __init__(self, node: Specialisation):
        self.node = node
        self.nodes: list[onnx.NodeProto] = []
        self._outputs: dict[str, str] = {}
        self._taken = set(node.op.input_names) | set(node.op.output_names)
        self._node_names: set[str] = set()
        self._count = 0

    # --- appending nodes -------------------------------------------------------------

    def __getattr__(self, op_type: str):
        if not op_type[:1].isupper():
            raise AttributeError(op_type)
        return lambda *inputs, **attrs: self.op(op_type, *inputs, **attrs)

    def op(self, op_type: str, *inputs: str | None, outputs: int = 1, name: str = "", **attrs) -> Any:
        names = [self._fresh(op_type) for _ in range(outputs)]
        name = self._node_name(name or names[0])
        self.nodes.append(helper.make_node(op_type, [x or "" for x in inputs], names, name=name, **attrs))
        return names[0] if outputs == 1 else names

    def Reshape(self, x: str, shape: str, **attrs) -> str:  # noqa: N802 - the op's name, as b.Gather
        """Reshape with ``allowzero=1``: bodies compute literal shapes, in which a 0 is an empty
        dim (T = 0), not "copy the input's dim" (ONNX's default)."""
        return self.op("Reshape", x, shape, allowzero=1, **attrs)

    def _node_name(self, name: str) -> str:
        """Node names are unique in a body (an inlined body's nodes must be unique in the graph)."""
        unique, count = name, 1
        while unique in self._node_names:
            count += 1
            unique = f"{name} ({count})"
        self._node_names.add(unique)
        return unique

    def _fresh(self, hint: str) -> str:
        while True:
            self._count += 1
            name = f"{hint}_{self._count}"
            if name not in self._taken:
                self._taken.add(name)
                return name

    def branch(self, build, dtype: str, rank: int) -> onnx.GraphProto:
        """A subgraph (an If branch) built by ``build(b) -> value``: its nodes may read any value
        of the body; it outputs that value, of element type ``dtype`` and rank ``rank``."""
        outer = self.nodes
        self.nodes = []
        try:
            value = build(self)
            nodes = self.nodes
        finally:
            self.nodes = outer
        output = helper.make_tensor_value_info(value, dtypes.onnx_type(dtype), [None] * rank)
        return helper.make_graph(nodes, self._fresh("branch"), [], [output])

    def loop(
        self,
        trips: str,
        state: Sequence[tuple[str, onnx.TypeProto]],
        build,
        scans: Sequence[tuple[str, int]] = (),
    ) -> list[str]:
        """A ``Loop`` of ``trips`` (a scalar int64 value) iterations: ``build(b, i, *state) ->
        [next state..., scan values...]`` writes the body (``i`` the scalar int64 iteration;
        it may read any value of the body). ``state``: (initial value, type) per loop-carried
        value; ``scans``: (element type, rank) per scan output (stacked along a new axis 0).
        Returns the final state values, then the scan outputs."""
        outer = self.nodes
        self.nodes = []
        iteration, condition = self._fresh("iteration"), self._fresh("condition")
        carried = [self._fresh("state") for _ in state]
        try:
            results = build(self, iteration, *carried)
            keep_going = self.Identity(condition)
            nodes = self.nodes
        finally:
            self.nodes = outer
        inputs = [helper.make_tensor_value_info(iteration, INT64, [])]
        inputs += [helper.make_tensor_value_info(condition, BOOL, [])]
        inputs += [helper.make_value_info(name, kind) for name, (_, kind) in zip(carried, state)]
        outputs = [helper.make_tensor_value_info(keep_going, BOOL, [])]
        outputs += [helper.make_value_info(name, kind) for name, (_, kind) in zip(results, state)]
        outputs += [
            helper.make_tensor_value_info(name, dtypes.onnx_type(dtype), [None] * rank)
            for name, (dtype, rank) in zip(results[len(state) :], scans)
        ]
        graph = helper.make_graph(nodes, self._fresh("loop"), inputs, outputs)
        count = len(state) + len(scans)
        true = self.Constant(value=helper.make_tensor("value", BOOL, [], [True]))  # (onnx.reference runs no
        # iteration without a condition input)
        results = self.op("Loop", trips, true, *[value for value, _ in state], outputs=count, body=graph)
        return [results] if count == 1 else results

    # --- constants and small shapes -------------------------------------------------

    def ints(self, values: Sequence[int]) -> str:
        """A 1-D int64 constant."""
        return self.Constant(value_ints=[int(v) for v in values])

    def int64(self, value: int) -> str:
        """A scalar int64 constant."""
        return self.Constant(value_int=int(value))

    def scalar(self, value, dtype: str) -> str:
        """A scalar constant of element type ``dtype`` (bfloat16 and float16 included)."""
        array = np.array(value, dtypes.numpy_dtype(dtype))
        return self.Constant(value=_tensor(array, dtype))

    def dim(self, x: str, axis: int) -> str:
        """``[1]`` int64: ``x.shape[axis]``."""
        return self.Shape(x, start=axis, end=axis + 1)

    def arange(self, n: str) -> str:
        """``[n]`` int64 ``0 .. n-1`` from ``n`` of shape ``[1]``."""
        return self.Range(self.int64(0), self.Squeeze(n, self.ints([0])), self.int64(1))

    def full(self, shape: str, value, dtype: str) -> str:
        """A tensor of ``shape`` (a 1-D int64 value) filled with ``value`` of ``dtype``.

        ConstantOfShape makes bfloat16 from opset 20; below, a float32 one is cast (exact for
        the values bodies use: 0 and small integers)."""
        if dtype == "bfloat16" and self.node.opset < 20:
            return self.cast(self.full(shape, value, "float32"), dtype)
        return self.ConstantOfShape(shape, value=_tensor(np.array([value], dtypes.numpy_dtype(dtype)), dtype))

    def cast(self, x: str, dtype: str) -> str:
        return self.Cast(x, to=dtypes.onnx_type(dtype))

    def flat(self, x: str) -> str:
        return self.Reshape(x, self.ints([-1]))

    def rows_of_slots(self, x: str) -> str:
        """``[E*C, H]``: a drop/pad ``[E, C, H]`` tensor as rows (slot ``e*C + c``), reshaped to
        explicit sizes (E or C may be 0: onnx.reference's Flatten fails on an empty tensor)."""
        slots = self.Mul(self.dim(x, 0), self.dim(x, 1))
        return self.Reshape(x, self.Concat(slots, self.dim(x, 2), axis=0))

    def safe_divisor(self, n: str) -> str:
        """``max(n, 1)``: legal empty cases (T = 0, E = 0) must not stop the run with onnxruntime's
        "Integer division by zero"; the quotient is not used then."""
        return self.Max(n, self.ints([1]))

    def stack(self, *columns: str) -> str:
        """``[n, len(columns)]`` from 1-D ``[n]`` values (GatherND / ScatterND indices)."""
        return self.Concat(*[self.Unsqueeze(c, self.ints([1])) for c in columns], axis=1)

    # --- float32 arithmetic --------------------------------------------------------

    def widen(self, x: str, dtype: str) -> str:
        """``x`` (of ``dtype``) as float32: exact for float16 and bfloat16."""
        return x if dtype == "float32" else self.Cast(x, to=FLOAT)

    def narrow(self, x: str, dtype: str) -> str:
        """float32 ``x`` rounded to nearest even into ``dtype`` (onnxruntime's Cast, like the kernels)."""
        return x if dtype == "float32" else self.cast(x, dtype)

    def sum_axis(self, x: str, axis: int, dtype: str) -> str:
        """Sum of ``x`` (of ``dtype``) over ``axis``, accumulated in float32, rounded once."""
        return self.narrow(self.ReduceSum(self.widen(x, dtype), self.ints([axis]), keepdims=0), dtype)

    def scatter_add_rows(self, rows: str, target: str, n: str, dtype: str | None = None) -> str:
        """``out[target[i]] += rows[i]`` into ``n`` zero rows, in float32, terms added in i order.

        Args:
            rows: ``[M, ...]`` float32 (or of ``dtype``, widened first).
            target: ``[M]`` int64 in ``[0, n]``; ``n`` is a spare row (skipped terms).
            n: ``[1]`` int64.
        Returns:
            ``[n, ...]`` float32 (rounded to ``dtype`` if given).
        """
        rows = rows if dtype is None else self.widen(rows, dtype)
        shape = self.Concat(self.Add(n, self.ints([1])), self.Shape(rows, start=1), axis=0)
        zeros = self.full(shape, 0.0, "float32")
        summed = self.ScatterND(zeros, self.Unsqueeze(target, self.ints([1])), rows, reduction="add")
        out = self.Slice(summed, self.ints([0]), n)
        return out if dtype is None else self.narrow(out, dtype)

    def zero_row_below(self, x: str, dtype: str) -> str:
        """``[R + 1, ...]``: ``x`` with a row of +0.0 appended (what an index R reads)."""
        row_shape = self.Concat(self.ints([1]), self.Shape(x, start=1), axis=0)
        return self.Concat(x, self.full(row_shape, 0, dtype), axis=0)

    def gather_or_zero_rows(self, x: str, index: str, dtype: str, rank: int, no_zero_row: str) -> str:
        """``Gather(x, index, axis=0)`` where an index equal to ``len(x)`` reads a row of +0.0.

        Appending the zero row copies ``x`` (measured: 0.35-0.4x the floor at Qwen3 shape), so an
        ``If`` appends it only when some index asks for it: ``no_zero_row`` (bool ``[1]``) says
        none does. ``dtype`` is ``x``'s element type, ``rank`` the result's rank.
        """
        plain = self.branch(lambda b: b.Gather(x, index, axis=0), dtype, rank)
        padded = self.branch(lambda b: b.Gather(b.zero_row_below(x, dtype), index, axis=0), dtype, rank)
        return self.If(no_zero_row, then_branch=plain, else_branch=padded)

    # --- checks ---------------------------------------------------------------------

    def check(self, x: str, ok: str, rule: str) -> str:
        """``x`` (int32/int64) unchanged if ``ok`` (bool ``[1]``), else a run-time error.

        Standard ONNX cannot raise. Here the flag itself is reshaped to ``[1]`` when true and to
        ``[2]`` when false, which no runtime can do, so the run fails at this node (onnxruntime
        names it; its name states the rule). ``x`` then passes through ``Where(flag, x, x)``,
        so nothing computed from the returned value runs before the check. (A Reshape of ``x``
        itself would not do: onnxruntime fuses consecutive Reshapes, dropping the checks.)
        """
        return self.Where(self._passed(ok, rule), x, x)

    def check_mask(self, mask: str, ok: str, rule: str) -> str:
        """:meth:`check` for a bool ``mask`` (onnxruntime has no bool Where): ``mask AND flag``."""
        return self.And(mask, self._passed(ok, rule))

    def check_dim_rules(self, rules: Sequence[DimRule]) -> None:
        """Check ``rules`` (:meth:`Specialisation.dim_rules`) before the body reads its index
        inputs: every integer or bool input (counts, indices, maps: small next to the rows)
        passes through the checks, so nothing computed from them runs on shapes the kernels
        refuse. (An output computed from shapes alone, such as an empty placeholder, does not
        wait for them; onnxruntime runs the checks anyway, measured with only that output
        asked for.) Call it once the body is written."""
        if not rules:
            return
        start = len(self.nodes)
        ok = self.rules_hold(rules)
        checked = {}
        for decl, dtype in zip(self.node.op.inputs, self.node.input_dtypes):
            if dtype is not None and set(decl.dtypes) <= _INDEX_DTYPES:
                name = decl.name
                checked[name] = self.And(name, ok) if dtype == "bool" else self.Where(ok, name, name)
        body, guard = self.nodes[:start], self.nodes[start:]
        for node in body:
            node.input[:] = [checked.get(x, x) for x in node.input]
        self._outputs = {k: checked.get(v, v) for k, v in self._outputs.items()}
        self.nodes = guard + body

    def shape_gate(self) -> Callable[[str], str]:
        """``gate(value)``: ``value`` once the op's shape rules on symbolic dims hold, else the
        run fails at the check naming the rule. For a body with no index input (which
        :meth:`check_dim_rules` would gate): it gates the values everything else is computed
        from, so nothing runs on shapes the kernel refuses."""
        rules = self.node.dim_rules()
        flag = self.rules_hold(rules) if rules else None
        return lambda value: value if flag is None else self.Where(flag, value, value)

    def rules_hold(self, rules: Sequence[DimRule]) -> str:
        """``[1]`` bool, true when every rule holds; otherwise the check node of a broken rule
        fails the run, naming it (see :meth:`check`). A body whose inputs are all floats gates
        its own first step on it (:meth:`check_dim_rules` gates only index inputs)."""
        passed = [self._passed(self._holds(rule), rule.rule) for rule in rules]
        ok = passed[0]
        for flag in passed[1:]:
            ok = self.And(ok, flag)
        return ok

    def _holds(self, rule: DimRule) -> str:
        """``[1]`` bool: ``rule`` holds for the inputs' run-time dims."""
        a, b, *more = (self._dim_value(d) for d in rule.dims)
        if rule.kind == "equal":
            return self.Equal(a, b)
        if rule.kind == "multiple":  # a == 0 when b == 0: the quotient by max(b, 1) times b is 0
            return self.Equal(self.Mul(self.Div(a, self.safe_divisor(b)), b), a)
        if rule.kind == "at_most":
            return self.LessOrEqual(a, b)
        if rule.kind == "quotient_at_most":  # (a is 0 when b is: a "multiple" rule says so)
            return self.LessOrEqual(self.Div(a, self.safe_divisor(b)), more[0])
        if rule.kind == "equal_min":
            return self.Equal(a, self.Min(b, more[0]))
        raise AssertionError(f"unknown DimRule kind {rule.kind!r}")

    def _dim_value(self, dim) -> str:
        """``[1]`` int64 of an int or of a ``<input>#<axis>`` dim."""
        if isinstance(dim, int):
            return self.ints([dim])
        name, axis = dim.rsplit("#", 1)
        return self.dim(name, int(axis))

    def _passed(self, ok: str, rule: str) -> str:
        target = self.Where(ok, self.ints([1]), self.ints([2]))
        return self.Reshape(ok, target, name=f"{self.node.op.name} check: {rule}")

    def none_true(self, flags: str) -> str:
        """``[1]`` bool: no element of ``flags`` (bool, any shape) is true (true when empty)."""
        count = self.ReduceSum(self.flat(self.cast(flags, "int64")), keepdims=1)
        return self.Equal(count, self.ints([0]))

    def all_equal(self, x: str, y: str) -> str:
        """``[1]`` bool: ``x == y`` everywhere (shapes as 1-D int64 values, say)."""
        return self.none_true(self.Not(self.Equal(x, y)))

    def check_range(self, index: str, low: str | int, high: str | int, rule: str) -> str:
        """``index`` (int64) checked to lie in ``[low, high)``; bounds are ints or ``[1]`` values."""
        low = self.ints([low]) if isinstance(low, int) else low
        high = self.ints([high]) if isinstance(high, int) else high
        outside = self.Or(self.Less(index, low), self.GreaterOrEqual(index, high))
        return self.check(index, self.none_true(outside), rule)

    # --- outputs and the function ----------------------------------------------------

    def output(self, name: str, value: str) -> None:
        if name not in self.node.op.output_names:
            raise KeyError(f"{self.node.op.name} has no output {name!r}")
        self._outputs[name] = value

    def function(self) -> onnx.FunctionProto:
        """The ``FunctionProto`` ``(cann.moe, <op>, <overload>)``.

        Formal inputs: the declared inputs up to the last present one; formal outputs: the
        declared outputs up to the last wanted one (an unwanted one in between gets an empty
        placeholder). The body is specialised; the op's attributes are declared with the
        specialisation's values as defaults (``attribute_proto``), so a runtime that makes a
        schema from the function accepts the node's attributes, and one that binds declared
        attributes from the node (onnx.reference binds those listed in ``attribute``) needs
        none of them.
        """
        op, node = self.node.op, self.node
        n_in = max((i + 1 for i, d in enumerate(node.input_dtypes) if d is not None), default=0)
        n_out = max((i + 1 for i, w in enumerate(node.wanted) if w), default=0)
        missing = [o for o, w in zip(op.output_names, node.wanted) if w and o not in self._outputs]
        if missing:
            raise AssertionError(f"{op.name} lowering did not bind {missing}")
        nodes = list(self.nodes)
        renames: dict[str, str] = {}
        produced = {out for n in nodes for out in n.output}
        bound: set[str] = set()
        for name in op.output_names[:n_out]:
            value = self._outputs.get(name)
            if value is None:  # an unwanted output before a wanted one
                empty = helper.make_tensor("value", INT32, [0], [])
                nodes.append(helper.make_node("Constant", [], [name], name=f"unwanted {name}", value=empty))
            elif value in produced and value not in bound and value not in renames:
                renames[value] = name  # rename in place: an Identity could copy a big tensor
            else:  # a formal input or a value already bound to another output
                nodes.append(helper.make_node("Identity", [renames.get(value, value)], [name], name=f"output {name}"))
            if value is not None:
                bound.add(value)
        for n in nodes:
            n.input[:] = [renames.get(x, x) for x in n.input]
            n.output[:] = [renames.get(x, x) for x in n.output]
        return helper.make_function(
            DOMAIN,
            op.name,
            op.input_names[:n_in],
            op.output_names[:n_out],
            nodes,
            [helper.make_opsetid("", node.opset)],
            attribute_protos=[helper.make_attribute(k, v) for k, v in node.attrs if v is not None],
            doc_string=f"{op.name} ({node.overload}) in standard ONNX ops, written by moe_onnx.lower",
            overload=node.overload,
        )


def _tensor(array: np.ndarray, dtype: str) -> onnx.TensorProto:
    """A TensorProto of ``array`` (shape kept) with element type ``dtype``, from raw bytes."""
    return helper.make_tensor("value", dtypes.onnx_type(dtype), array.shape, array.tobytes(), raw=True)
