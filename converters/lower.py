"""``lower(model)``: every ``cann.moe`` node except the collectives, defined in standard ONNX ops.

Default: each node stays as it is (domain ``cann.moe``, its op type and attributes), gains an
``overload`` naming its specialisation, and the model carries one model-local
``FunctionProto`` ``(cann.moe, <op type>, <overload>)`` per distinct specialisation. A runtime
with a kernel for the op (moe-onnx, an NPU runtime) runs its kernel and may ignore the
function; any other runtime finds the function by (domain, name, overload) and runs its body
(onnxruntime inlines it). ``inline=True`` replaces each node by its body instead, so the
model holds no ``cann.moe`` node but the collectives.

Bodies are written for the model's default-domain opset, which must be at least 18.
"""

from __future__ import annotations

import dataclasses

import onnx
from onnx import helper

from moe_onnx.custom_ops import DOMAIN, OPS, TensorInfo
from moe_onnx.custom_ops.model_types import graphs, value_types
from moe_onnx.custom_ops.schemas import check_attribute_types

from .expert_weights import ExpertWeights
from .lowering import LOWERINGS, MIN_OPSET, Body, LoweringError, Specialisation
from .model_input import as_proto

#: model-local functions with overloads need IR version 10
_IR_WITH_OVERLOADS = 10


def lower(model, *, inline: bool = False) -> onnx.ModelProto:
    """A copy of ``model`` in which every ``cann.moe`` op but the collectives has a body in
    standard ONNX ops: model-local functions (default) or, with ``inline``, the bodies in
    place of the nodes. ``model``: an ``onnx.ModelProto`` (not modified), an ``onnx_ir.Model``
    or a path to a model file. A model with no op to lower comes back as it is (a copy).
    Raises :class:`MoeOpError` for a node that breaks its op's static rules,
    :class:`LoweringError` for one that cannot be lowered.
    """
    return LowerToStandard(inline=inline)(as_proto(model))


def has_lowerable(model: onnx.ModelProto) -> bool:
    """Whether ``model``'s graph (subgraphs included) holds a ``cann.moe`` op with a body."""
    return any(n.domain == DOMAIN and n.op_type in LOWERINGS for g in graphs(model.graph) for n in g.node)


class LowerToStandard:
    """The pass: ``LowerToStandard(inline=False)(model) -> new model``."""

    def __init__(self, inline: bool = False):
        self.inline = inline

    def __call__(self, model: onnx.ModelProto) -> onnx.ModelProto:
        result = onnx.ModelProto()
        result.CopyFrom(model)
        if not has_lowerable(model):  # nothing to lower: any opset will do
            return result
        opset = default_opset(model)
        types = value_types(model)
        functions: dict[Specialisation, onnx.FunctionProto] = {}
        names = NameSource(result)
        expert_weights = ExpertWeights(result, names)
        for graph in graphs(result.graph):
            nodes = []
            for node in graph.node:
                if node.domain != DOMAIN or node.op_type not in LOWERINGS:
                    nodes.append(node)
                    continue
                trim_trailing_empty(node)
                spec = specialise(node, types, opset)
                shape = expert_weights.shape(node, spec) if self.inline and graph is result.graph else ()
                if shape:
                    spec = dataclasses.replace(spec, expert_weights=shape)
                if spec not in functions:
                    functions[spec] = build_function(spec)
                if self.inline:
                    bound = expert_weights.binding(node, shape[0]) if shape else {}
                    nodes.extend(inline_call(node, functions[spec], names, bound))
                else:
                    node.overload = spec.overload
                    nodes.append(node)
            del graph.node[:]
            graph.node.extend(nodes)
        expert_weights.drop_unread({x for g in graphs(result.graph) for n in g.node for x in n.input})
        ours = {(f.domain, f.name, f.overload) for f in functions.values()}
        kept = [f for f in result.functions if (f.domain, f.name, f.overload) not in ours or not self.inline]
        present = {(f.domain, f.name, f.overload) for f in kept}
        if not self.inline:
            kept += [f for f in functions.values() if (f.domain, f.name, f.overload) not in present]
            result.ir_version = max(result.ir_version, _IR_WITH_OVERLOADS)
        del result.functions[:]
        result.functions.extend(kept)
        if not any(n.domain == DOMAIN for g in graphs(result.graph) for n in g.node) and not any(
            n.domain == DOMAIN for f in result.functions for n in f.node
        ):
            imports = [o for o in result.opset_import if o.domain != DOMAIN]
            del result.opset_import[:]
            result.opset_import.extend(imports)
        return result


def trim_trailing_empty(node: onnx.NodeProto) -> None:
    """Drop trailing "" inputs and outputs (the same node in ONNX), so that the node has
    exactly as many as its function's formal parameters (onnx.reference requires that)."""
    while node.input and not node.input[-1]:
        node.input.pop()
    while node.output and not node.output[-1]:
        node.output.pop()


def default_opset(model: onnx.ModelProto) -> int:
    version = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    if version is None or version < MIN_OPSET:
        raise ValueError(
            f"lowering writes bodies for the model's default-domain opset, which must be >= {MIN_OPSET}; "
            f"the model imports {version} (onnx.version_converter.convert_version can raise it)"
        )
    return version


def specialise(node: onnx.NodeProto, types: dict[str, TensorInfo], opset: int) -> Specialisation:
    """The node's specialisation, after checking it against its op's static rules."""
    op = OPS[node.op_type]
    inputs: list[TensorInfo | None] = []
    for decl, name in zip(op.inputs, list(node.input) + [""] * (len(op.inputs) - len(node.input))):
        if not name:
            inputs.append(None)
            continue
        info = types.get(name)
        if info is None or info.dtype is None:
            raise LoweringError(op.name, f"the element type of input '{decl.name}' ({name}) is unknown", node.name)
        if info.shape is None:  # the body checks the op's shape rules per dim (dim_rules)
            raise LoweringError(
                op.name,
                f"the rank of input '{decl.name}' ({name}) is unknown; give it a shape (its dims may be symbolic)",
                node.name,
            )
        inputs.append(info)
    check_attribute_types(op, node.attribute, node.name)
    attrs = {}
    for attr in node.attribute:
        value = helper.get_attribute_value(attr)
        attrs[attr.name] = value.decode() if isinstance(value, bytes) else value
    wanted = {o for o, name in zip(op.output_names, node.output) if name}
    sig = op.signature(inputs, attrs, wanted, node_name=node.name)  # raises MoeOpError
    return Specialisation(
        op=op,
        attrs=tuple((a.name, _hashable(sig.attrs[a.name])) for a in op.attrs),
        input_dtypes=tuple(None if i is None else i.dtype for i in inputs),
        wanted=tuple(o in wanted for o in op.output_names),
        opset=opset,
        input_ranks=tuple(None if i is None or i.shape is None else len(i.shape) for i in inputs),
        node_name=node.name,
    )


def _hashable(value):
    return tuple(value) if isinstance(value, list) else value


def build_function(spec: Specialisation) -> onnx.FunctionProto:
    body = Body(spec)
    LOWERINGS[spec.op.name](body, spec)
    body.check_dim_rules(spec.dim_rules())  # the shape rules, for dims unknown when lowering
    return body.function()


class NameSource:
    """Fresh value and node names for inlined bodies, unique in the whole model."""

    def __init__(self, model: onnx.ModelProto):
        self.taken: set[str] = set()
        for g in graphs(model.graph):
            self.taken.update(v.name for v in list(g.input) + list(g.output) + list(g.value_info))
            self.taken.update(i.name for i in g.initializer)
            for n in g.node:
                self.taken.update(n.input)
                self.taken.update(n.output)
        self.count = 0

    def prefix(self, base: str) -> str:
        """A prefix ``base/`` (or ``base.N/``) that starts no name taken so far."""
        candidate = f"{base}/"
        while any(name.startswith(candidate) for name in self.taken):
            self.count += 1
            candidate = f"{base}.{self.count}/"
        self.taken.add(candidate)
        return candidate


def inline_call(
    node: onnx.NodeProto, function: onnx.FunctionProto, names: NameSource, bound_names: dict[str, str] | None = None
) -> list[onnx.NodeProto]:
    """The body of ``function`` bound to ``node``'s inputs and outputs (and the body's other
    names in ``bound_names`` to the values given there: per-expert weights).

    Values and nodes of the body are prefixed with the node's name (``<node>/``), so a failing
    check names the node it guards. (Our bodies have no attribute references; their If branches
    and Loop bodies share the body's unique names, their formal inputs included.)
    """
    prefix = names.prefix(node.name or node.op_type)
    binding = {formal: actual for formal, actual in zip(function.input, node.input)}
    binding.update({formal: actual for formal, actual in zip(function.output, node.output) if actual})
    binding.update(bound_names or {})

    def bound(name: str) -> str:
        if not name:
            return ""
        if name not in binding:
            binding[name] = prefix + name
        return binding[name]

    def renamed(body_nodes) -> list[onnx.NodeProto]:
        nodes = []
        for body_node in body_nodes:
            copy = onnx.NodeProto()
            copy.CopyFrom(body_node)
            copy.input[:] = [bound(x) for x in body_node.input]
            copy.output[:] = [bound(x) for x in body_node.output]
            copy.name = prefix + body_node.name
            for attr in copy.attribute:
                if attr.HasField("g"):  # If branches and Loop bodies: names unique in the body
                    branch_nodes = renamed(attr.g.node)
                    del attr.g.node[:]
                    attr.g.node.extend(branch_nodes)
                    for value in list(attr.g.input) + list(attr.g.output):
                        value.name = bound(value.name)
                    attr.g.name = prefix + attr.g.name
            nodes.append(copy)
        return nodes

    return renamed(function.node)
