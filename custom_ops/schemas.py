"""ONNX ``OpSchema`` objects derived from :class:`OpDef`, registered with ``onnx.defs``."""

from __future__ import annotations

import re

import onnx
import onnx.defs
from onnx import helper

from . import dtypes
from .opdef import OpDef, TensorInfo

_P = onnx.defs.OpSchema.FormalParameter
_OPTION = onnx.defs.OpSchema.FormalParameterOption
_ATTR_TYPES = {
    "int": onnx.defs.OpSchema.AttrType.INT,
    "ints": onnx.defs.OpSchema.AttrType.INTS,
    "float": onnx.defs.OpSchema.AttrType.FLOAT,
    "string": onnx.defs.OpSchema.AttrType.STRING,
}


def _tensor_info(type_proto: onnx.TypeProto | None) -> TensorInfo:
    if type_proto is None or not type_proto.HasField("tensor_type"):
        return TensorInfo(None, None)
    tensor = type_proto.tensor_type
    dtype = dtypes.name_of_onnx(tensor.elem_type) if tensor.elem_type else None
    if not tensor.HasField("shape"):
        return TensorInfo(dtype, None)
    dims = []
    for d in tensor.shape.dim:
        dims.append(d.dim_value if d.HasField("dim_value") else (d.dim_param or None))
    return TensorInfo(dtype, tuple(dims))


def _type_proto(info: TensorInfo) -> onnx.TypeProto:
    return helper.make_tensor_type_proto(dtypes.onnx_type(info.dtype), None if info.shape is None else list(info.shape))


def _inference_function(op: OpDef):
    def infer(ctx) -> None:
        n_in, n_out = ctx.get_num_inputs(), ctx.get_num_outputs()
        inputs = [
            _tensor_info(ctx.get_input_type(i)) if ctx.has_input(i) else None for i in range(min(n_in, len(op.inputs)))
        ]
        attrs = {}
        for a in op.attrs:
            proto = ctx.get_attribute(a.name)
            if proto is not None:
                attrs[a.name] = helper.get_attribute_value(proto)
                if isinstance(attrs[a.name], bytes):
                    attrs[a.name] = attrs[a.name].decode()
        wanted = {o.name for i, o in enumerate(op.outputs) if i < n_out and ctx.has_output(i)}
        # "node Op[domain] (name)" -> "name"
        name = re.sub(r"^node .*? \((.*)\)$", r"\1", ctx.get_display_name())
        sig = op.signature(inputs, attrs, wanted, node_name=name)
        for i, o in enumerate(op.outputs):
            info = sig.outputs.get(o.name)
            if o.name in wanted and info is not None and info.dtype is not None:  # unknown stays unset
                ctx.set_output_type(i, _type_proto(info))

    return infer


def make_schema(op: OpDef) -> onnx.defs.OpSchema:
    """The ``OpSchema`` of ``op``: one type parameter per input and per output."""
    constraints, inputs, outputs = [], [], []
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
        1,
        op.doc,
        inputs=inputs,
        outputs=outputs,
        type_constraints=constraints,
        attributes=attributes,
    )
    schema.set_type_and_shape_inference_function(_inference_function(op))
    return schema


def onnx_name(dtype: str) -> str:
    """The type string ONNX uses in ``tensor(...)`` for the element type ``dtype``."""
    return {"float32": "float", "float64": "double"}.get(dtype, dtype)


def register(ops) -> None:
    """Register every schema once per process (importing twice is harmless)."""
    for op in ops:
        if not onnx.defs.has(op.name, op.domain):
            onnx.defs.register_schema(make_schema(op))
