"""Creating the onnxruntime sessions the executors run, external data included."""

from __future__ import annotations

import os
import tempfile

import onnx
import onnxruntime as ort

from .pyops import REGISTRY

_SPINNING = "session.intra_op.allow_spinning"


def _external_locations(model: onnx.ModelProto) -> set[str]:
    return {
        entry.value
        for tensor in model.graph.initializer
        if tensor.data_location == onnx.TensorProto.EXTERNAL
        for entry in tensor.external_data
        if entry.key == "location"
    }


def create(
    model: onnx.ModelProto, base_dir: str | None, options: ort.SessionOptions, providers: list[str], **kwargs
) -> ort.InferenceSession:
    """An onnxruntime session of ``model``; external data is read where the model lives.

    onnxruntime resolves external data relative to the model file and refuses paths (or
    links) leading out of its folder, so a model whose weights are external (beyond
    protobuf's 2 GB too) is written, small, as a hidden file beside the original for the
    moment the session is created, then removed. Where that folder is read-only, the weights
    are read into memory instead (which needs a model under 2 GB).
    """
    if not _external_locations(model):
        return _session(model.SerializeToString(), options, providers, kwargs)
    try:
        handle, path = tempfile.mkstemp(prefix=".moe_onnx_", suffix=".onnx", dir=base_dir)
    except OSError:
        onnx.load_external_data_for_model(model, base_dir or ".")
        return _session(model.SerializeToString(), options, providers, kwargs)
    try:
        with os.fdopen(handle, "wb") as f:
            f.write(model.SerializeToString())
        return _session(path, options, providers, kwargs)
    finally:
        os.remove(path)


def _session(model: bytes | str, options: ort.SessionOptions, providers: list[str], kwargs) -> ort.InferenceSession:
    # not while another thread adds a PyOp to the extensions' registry (see pyops.REGISTRY)
    with REGISTRY.lock:
        return ort.InferenceSession(model, options, providers=providers, **kwargs)


def without_spinning(options: ort.SessionOptions) -> ort.SessionOptions:
    """Segments alternate with our kernels (and other ranks' threads): onnxruntime's idle
    workers spinning after each segment take the cores those need (4 thread ranks of the EP
    layer: 640 -> 332 ms a forward). An explicit setting of the caller's is kept."""
    try:
        options.get_session_config_entry(_SPINNING)
    except RuntimeError:  # not set
        options.add_session_config_entry(_SPINNING, "0")
    return options
