"""Every ``cann.moe`` operator as a ``torch.library`` custom op in the ``cann_moe`` namespace.

Each op is defined from its :class:`OpDef`: the schema (``schema.torch_schema``), a CPU
implementation that calls the op's validated numpy kernel on zero-copy views of the tensors
(``arrays``), and a fake implementation that runs the op's shape inference instead
(``shapes``), so ``torch.export`` and ``torch.compile`` trace the ops without running them.
Ops that need a communicator (AllToAll, AllGather) get one on ``torch.distributed``.

The public functions (``moe_re_routing_v2(...)`` etc.) wrap the ops: absent optional outputs
come back as None, one output comes back as a tensor, several as a tuple.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..custom_ops import BAD_DTYPE, OPS, MoeOpError, OpDef
from . import shapes
from .arrays import dtype_name, tensor_problem, to_numpy
from .collectives import communicator_for
from .outputs import TorchOutputs
from .schema import NAMESPACE, docstring, python_signature, snake_case, torch_schema

LIBRARY = torch.library.Library(NAMESPACE, "DEF")


def _cpu_impl(op: OpDef) -> Callable:
    def impl(*inputs, **attrs):
        arrays = [None if t is None else to_numpy(t) for t in inputs]
        context = {"communicator": communicator_for(op.name, attrs)} if "communicator" in op.needs else None
        allocation = TorchOutputs()
        with allocation.installed():
            results = op(*arrays, context=context, **attrs)
        outputs = [
            shapes.placeholder(decl) if value is None else allocation.tensor(value, position)
            for position, (decl, value) in enumerate(zip(op.outputs, results))
        ]
        return outputs[0] if len(outputs) == 1 else tuple(outputs)

    return impl


def _fake_impl(op: OpDef) -> Callable:
    def fake(*inputs, **attrs):
        outputs = shapes.fake_outputs(op, inputs, attrs)
        return outputs[0] if len(outputs) == 1 else tuple(outputs)

    return fake


def _define(op: OpDef):
    name = snake_case(op.name)
    LIBRARY.define(name + torch_schema(op))
    LIBRARY.impl(name, _cpu_impl(op), "CPU")
    torch.library.register_fake(f"{NAMESPACE}::{name}", _fake_impl(op), lib=LIBRARY)
    return getattr(getattr(torch.ops, NAMESPACE), name).default


def _every_slot(inputs: dict, name: str, rows: str, value) -> bool:
    """Is ``value`` a symbolic size known, without a guard, to equal T*K, the slots of
    ``inputs[name]`` (``[T, K]``; ``[T]``: K = 1)? torch.export gives each input's dynamic dim
    its own symbol until it unifies them after tracing, so T is asked of ``inputs[rows]`` too."""
    index, tokens = inputs.get(name), inputs.get(rows)
    if not isinstance(value, torch.SymInt) or index is None:
        return False
    top_k = index.shape[-1] if index.dim() == 2 else 1
    sizes = [index.numel(), index.shape[0] * top_k] + ([] if tokens is None else [tokens.shape[0] * top_k])
    return any(statically_known_true(value == size) for size in sizes)


#: (op, attribute) -> (the index whose slots a symbolic value may count, the rows input, the
#: constant meaning "every slot" at every T): the spellings torch_npu's names take (num_out_tokens = T*K,
#: active_num = T*K), so a layer written with these ops exports with a dynamic token count
EVERY_SLOT = {
    ("MoeTokenPermute", "num_out_tokens"): ("indices", "tokens", 0),
    ("MoeInitRoutingV3", "active_num"): ("expert_idx", "x", -1),
    ("MoeInitRoutingV2", "active_num"): ("expert_idx", "x", 0),
}
#: (op, attribute): attributes the kernel does not read outside padded mode (restore_shape of
#: the unpermute: its rows come from sorted_indices), dropped when symbolic there
UNREAD_UNPADDED = {("MoeTokenUnpermute", "restore_shape"), ("MoeTokenUnpermuteGrad", "restore_shape")}


def _symbolic_spellings(op: OpDef, inputs: dict, attrs: dict) -> dict:
    """``attrs`` with the symbolic sizes that mean a constant at every T replaced by it."""
    out = dict(attrs)
    for name, value in attrs.items():
        rule = EVERY_SLOT.get((op.name, name))
        if rule is not None and _every_slot(inputs, rule[0], rule[1], value):
            out[name] = rule[2]
        values = value if isinstance(value, (list, tuple)) else [value]
        symbolic = any(isinstance(v, torch.SymInt) for v in values)
        if (op.name, name) in UNREAD_UNPADDED and symbolic and not attrs.get("padded_mode"):
            out[name] = None
    return out


class SymbolicAttributeError(TypeError):
    """An attribute given a symbolic size that no constant stands for (the export's limit)."""


def _refuse_symbolic_attrs(op: OpDef, attrs: dict) -> None:
    for name, value in attrs.items():
        values = value if isinstance(value, (list, tuple)) else [value]
        if any(isinstance(v, (torch.SymInt, torch.Tensor)) for v in values):  # jit.trace: sizes are tensors
            raise SymbolicAttributeError(
                f"{op.name}: attribute {name} = {value} is symbolic; ONNX attributes are constants of the graph, "
                "so it cannot follow a dynamic size (see docs/torch.md, Limits)"
            )


def _plain_ints(op: OpDef, attrs: dict) -> dict:
    """``attrs`` with bools given for int attributes as 0 / 1 (the OpDef takes a bool as an
    int; torch's ``int`` schema arguments are given ints)."""
    kinds = {a.name: a.kind for a in op.attrs}
    out = {}
    for name, value in attrs.items():
        if kinds[name] == "int" and isinstance(value, (bool, np.bool_)):
            value = int(value)
        elif kinds[name] == "ints" and isinstance(value, (list, tuple)):
            value = [int(v) if isinstance(v, (bool, np.bool_)) else v for v in value]
        out[name] = value
    return out


def _specialized(op: OpDef, attrs: dict) -> dict:
    """``attrs`` with each int made a constant of the graph, while torch.compile traces:
    ``dynamic=True`` hands Python ints over as symbols, which an attribute cannot be.
    ``operator.index`` makes dynamo guard on the value (another value compiles another graph;
    ``int()`` would keep the symbol). Non-integers (0.5) are left for the OpDef to refuse."""
    kinds = {a.name: a.kind for a in op.attrs}

    def constant(value):
        return operator.index(value) if isinstance(value, int) else value

    out = {}
    for name, value in attrs.items():
        if kinds[name] == "int":
            value = constant(value)
        elif kinds[name] == "ints" and isinstance(value, (list, tuple)):
            value = [constant(v) for v in value]
        out[name] = value
    return out


def _public_function(op: OpDef, overload) -> Any:
    signature = python_signature(op)
    input_names = op.input_names
    attr_names = [a.name for a in op.attrs]

    def function(*args, **kwargs) -> Any:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        inputs = [bound.arguments[n] for n in input_names]
        for name, value in zip(input_names, inputs):
            problem = None if value is None else tensor_problem(value)
            if problem is not None:
                raise MoeOpError(f"input {name}: {problem}", BAD_DTYPE, op_type=op.name)
        attrs = _plain_ints(op, {n: bound.arguments[n] for n in attr_names})
        if torch.compiler.is_dynamo_compiling():
            attrs = _specialized(op, attrs)
        attrs = _symbolic_spellings(op, dict(zip(input_names, inputs)), attrs)
        _refuse_symbolic_attrs(op, attrs)
        present = shapes.present_outputs(op, [None if t is None else dtype_name(t.dtype) for t in inputs], attrs)
        outputs = overload(*inputs, **{n: v for n, v in attrs.items() if v is not None})
        if len(op.outputs) == 1:
            return outputs
        return tuple(out if keep else None for out, keep in zip(outputs, present))

    public: Any = function  # it carries its signature, op and overload as attributes
    public.__name__ = public.__qualname__ = snake_case(op.name)
    public.__signature__ = signature
    public.__doc__ = docstring(op)
    public.op = op
    public.overload = overload
    return public


#: op type -> the torch op overload (``torch.ops.cann_moe.<snake_case>.default``)
OVERLOADS = {name: _define(op) for name, op in OPS.items()}
#: op type -> the public function
FUNCTIONS = {name: _public_function(OPS[name], overload) for name, overload in OVERLOADS.items()}
