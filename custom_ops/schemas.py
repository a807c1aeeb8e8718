"""ONNX ``OpSchema`` objects derived from :class:`OpDef`, registered with ``onnx.defs``."""

from __future__ import annotations

import re
from collections.abc import Iterable

import onnx
import onnx.defs
from onnx import helper

from .errors import MoeOpError
from .opdef import OPSET_VERSION, OpDef
from .tensor_info import TensorInfo, onnx_name

_P = onnx.defs.OpSchema.FormalParameter
_OPTION = onnx.defs.OpSchema.FormalParameterOption
_ATTR_TYPES = {
    "int": onnx.defs.OpSchema.AttrType.INT,
    "ints": onnx.defs.OpSchema.AttrType.INTS,
    "float": onnx.defs.OpSchema.AttrType.FLOAT,
    "string": onnx.defs.OpSchema.AttrType.STRING,
}


def _inference_function(op: OpDef):
    def infer(ctx) -> None:
        n_in, n_out = ctx.get_num_inputs(), ctx.get_num_outputs()
        inputs = [
            TensorInfo.from_type_proto(ctx.get_input_type(i)) if ctx.has_input(i) else None
            for i in range(min(n_in, len(op.inputs)))
        ]
        protos = {a.name: ctx.get_attribute(a.name) for a in op.attrs}
        attrs = {name: attribute_value(proto) for name, proto in protos.items() if proto is not None}
        wanted = {o.name for i, o in enumerate(op.outputs) if i < n_out and ctx.has_output(i)}
        # "node Op[domain] (name)" -> "name"
        name = re.sub(r"^node .*? \((.*)\)$", r"\1", ctx.get_display_name())
        sig = op.signature(inputs, attrs, wanted, node_name=name)
        for i, o in enumerate(op.outputs):
            info = sig.outputs.get(o.name)
            if o.name in wanted and info is not None and info.dtype is not None:  # unknown stays unset
                ctx.set_output_type(i, info.type_proto())

    return infer


def attribute_value(proto: onnx.AttributeProto):
    """An attribute as Python: numbers, lists, strings decoded."""
    value = helper.get_attribute_value(proto)
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, list):
        return [v.decode() if isinstance(v, bytes) else v for v in value]
    return value


#: the AttributeProto type of each attribute kind (what onnx.checker requires)
_ATTRIBUTE_TYPES = {
    "int": onnx.AttributeProto.INT,
    "ints": onnx.AttributeProto.INTS,
    "float": onnx.AttributeProto.FLOAT,
    "string": onnx.AttributeProto.STRING,
}


def check_attribute_types(op: OpDef, attributes: Iterable[onnx.AttributeProto], node_name: str = "") -> None:
    """Each attribute has the ONNX type its declaration says (a FLOAT 0.5 where an INT is
    declared would otherwise be read as a number, an INT where a FLOAT is declared accepted by
    one runtime and refused by another). Both executors and ``lower()`` check it."""
    declared = {a.name: a for a in op.attrs}
    for proto in attributes:
        attr = declared.get(proto.name)
        if attr is not None and proto.type != _ATTRIBUTE_TYPES[attr.kind]:
            kind = onnx.AttributeProto.AttributeType.Name(proto.type)
            raise MoeOpError(
                f"attribute '{attr.name}' must be of type {attr.kind.upper()}, got {kind}",
                op_type=op.name,
                node_name=node_name,
            )


def make_schema(op: OpDef) -> onnx.defs.OpSchema:
    """The ``OpSchema`` of ``op``: one type parameter per input and per output."""
    constraints: list[tuple[str, list[str], str]] = []
    inputs: list[onnx.defs.OpSchema.FormalParameter] = []
    outputs: list[onnx.defs.OpSchema.FormalParameter] = []
    for params, decls, prefix in ((inputs, op.inputs, "T_"), (outputs, op.outputs, "O_")):
        for d in decls:
            type_param = prefix + d.name
            constraints.append((type_param, [f"tensor({onnx_name(t)})" for t in d.dtypes], ""))
            params.append(
                _P(d.name, type_param, d.doc, param_option=_OPTION.Optional if d.optional else _OPTION.Single)
            )
    attributes = []
    for a in op.attrs:
        if a.default is None:
            attributes.append(onnx.defs.OpSchema.Attribute(a.name, _ATTR_TYPES[a.kind], a.doc, required=a.required))
        else:
            attributes.append(onnx.defs.OpSchema.Attribute(a.name, helper.make_attribute(a.name, a.default), a.doc))
    schema = onnx.defs.OpSchema(
        op.name,
        op.domain,
        OPSET_VERSION,
        op.doc,
        inputs=inputs,
        outputs=outputs,
        type_constraints=constraints,
        attributes=attributes,
    )
    schema.set_type_and_shape_inference_function(_inference_function(op))
    return schema


def register(ops) -> None:
    """Register every schema once per process (importing twice is harmless)."""
    for op in ops:
        if not onnx.defs.has(op.name, op.domain):
            onnx.defs.register_schema(make_schema(op))
