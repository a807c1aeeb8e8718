"""Creating the onnxruntime sessions the executors run (external data included), and tensors
crossing into and out of onnxruntime by reference (bfloat16 and float8 as their bits)."""

from __future__ import annotations

import ctypes
import os
import tempfile

import numpy as np
import onnx
import onnxruntime as ort

from ..custom_ops import dtypes
from ..custom_ops.model_types import graphs
from ..interrupts import held
from .pyops import REGISTRY

_SPINNING = "session.intra_op.allow_spinning"


def _external_locations(model: onnx.ModelProto) -> set[str]:
    return {
        entry.value
        for graph in graphs(model.graph)  # an If/Loop body's initializers too
        for tensor in graph.initializer
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

    SIGINT and SIGTERM are held while that file exists (in the main thread; see
    :mod:`moe_onnx.interrupts`), so they cannot leave it behind; onnxruntime could not be
    interrupted while creating the session anyway.
    """
    if not _external_locations(model):
        return _session(model.SerializeToString(), options, providers, kwargs)
    with held():
        try:
            handle, path = tempfile.mkstemp(prefix=".moe_onnx_", suffix=".onnx", dir=base_dir)
        except OSError:
            path = None
        if path is not None:
            try:
                with os.fdopen(handle, "wb") as f:
                    f.write(model.SerializeToString())
                return _session(path, options, providers, kwargs)
            finally:
                os.remove(path)
    onnx.load_external_data_for_model(model, base_dir or ".")
    return _session(model.SerializeToString(), options, providers, kwargs)


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


def to_ort(array: np.ndarray) -> ort.OrtValue:
    """An OrtValue over ``array``'s memory (ml_dtypes arrays pass as their bits)."""
    array = np.asarray(array, order="C")  # (ascontiguousarray would make a 0-d array 1-d)
    name = dtypes.name_of(array)
    if name in dtypes.ML_DTYPES:
        carrier = np.dtype(f"u{array.dtype.itemsize}")
        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(array.view(carrier), dtypes.onnx_type(name))
    return ort.OrtValue.ortvalue_from_numpy(array)


def from_ort(value: ort.OrtValue) -> np.ndarray:
    """A numpy array over ``value``'s memory, of the real dtype (bfloat16 as ml_dtypes)."""
    name = value.data_type()[len("tensor(") : -1]
    if name not in dtypes.ML_DTYPES:
        return value.numpy()
    # numpy() refuses types numpy lacks: wrap the bytes, keeping the OrtValue alive
    raw = (ctypes.c_char * value.tensor_size_in_bytes()).from_address(value.data_ptr())
    raw.owner = value
    return np.frombuffer(raw, dtypes.numpy_dtype(name)).reshape(value.shape())
