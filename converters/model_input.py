"""What the public functions that take a model accept: an ``onnx.ModelProto``, an
``onnx_ir.Model``, or a path to a model file (``str`` or ``os.PathLike``; serialised bytes
too). Each function converts to the form it works on, and returns the form it documents."""

from __future__ import annotations

import os

import onnx
import onnx_ir as ir

#: what a model argument may be, for messages
ACCEPTED = "an onnx.ModelProto, an onnx_ir.Model or a path to a .onnx file"


def as_proto(model, load_external_data: bool = True) -> onnx.ModelProto:
    """``model`` as a ModelProto: the same object when it is one (never modified), an
    ``onnx_ir.Model`` serialised (external tensors stay references), a path loaded (with
    its external data unless ``load_external_data`` is False), bytes parsed."""
    if isinstance(model, onnx.ModelProto):
        return model
    if isinstance(model, ir.Model):
        return ir.serde.serialize_model(model)
    if isinstance(model, (bytes, bytearray)):
        return onnx.load_from_string(bytes(model))
    return onnx.load(_path(model), load_external_data=load_external_data)


def as_ir(model) -> ir.Model:
    """``model`` as an ``onnx_ir.Model``: the same object when it is one, a ModelProto
    deserialised, a path loaded with its external data referenced, not read."""
    if isinstance(model, ir.Model):
        return model
    if isinstance(model, onnx.ModelProto):
        return ir.serde.deserialize_model(model)
    if isinstance(model, (bytes, bytearray)):
        return ir.serde.deserialize_model(onnx.load_from_string(bytes(model)))
    return ir.load(_path(model))


def _path(model) -> str:
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"model must be {ACCEPTED}, got {type(model).__name__}")
    path = os.fspath(model)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"model file {path} does not exist")
    return path
