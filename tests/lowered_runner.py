"""Run lowered models with stock runtimes only, in a process that never imports moe_onnx.

    python tests/lowered_runner.py      # a worker: pickled requests on stdin, replies on stdout

Each request is ``{"model": bytes, "feeds": {name: array}, "check": bool}``; arrays travel as
``(dtype name, shape, bytes)``. The reply holds, per runtime ("onnxruntime" and "reference",
i.e. ``onnxruntime.InferenceSession`` and ``onnx.reference.ReferenceEvaluator``), the outputs
in graph order or the error message; "checker" holds the error of ``onnx.checker.check_model
(full_check=True)`` plus strict shape inference (None if both pass); "moe_onnx_imported"
says whether anything imported moe_onnx (it must not). Only numpy, ml_dtypes, onnx and
onnxruntime are imported here.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import sys

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
from onnx.reference import ReferenceEvaluator

_ML = {
    "bfloat16": (ml_dtypes.bfloat16, onnx.TensorProto.BFLOAT16),
    "float8_e4m3fn": (ml_dtypes.float8_e4m3fn, onnx.TensorProto.FLOAT8E4M3FN),
    "float8_e5m2": (ml_dtypes.float8_e5m2, onnx.TensorProto.FLOAT8E5M2),
    "float8_e8m0fnu": (ml_dtypes.float8_e8m0fnu, onnx.TensorProto.FLOAT8E8M0),
}
_ORT_TO_NUMPY = {
    "float": "float32",
    "double": "float64",
    "float8e4m3fn": "float8_e4m3fn",
    "float8e5m2": "float8_e5m2",
    "float8e8m0": "float8_e8m0fnu",
}


def numpy_dtype(name: str) -> np.dtype:
    return np.dtype(_ML[name][0]) if name in _ML else np.dtype(name)


def pack(array: np.ndarray) -> tuple[str, tuple, bytes]:
    array = np.ascontiguousarray(array)
    return str(array.dtype), array.shape, array.tobytes()


def unpack(packed: tuple[str, tuple, bytes]) -> np.ndarray:
    name, shape, data = packed
    return np.frombuffer(data, numpy_dtype(name)).reshape(shape).copy()


def to_ort(array: np.ndarray) -> ort.OrtValue:
    name = str(array.dtype)
    if name in _ML:
        bits = array.view(np.dtype(f"u{array.dtype.itemsize}"))
        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(bits, _ML[name][1])
    return ort.OrtValue.ortvalue_from_numpy(array)


def from_ort(value: ort.OrtValue) -> np.ndarray:
    name = value.data_type()[len("tensor(") : -1]
    name = _ORT_TO_NUMPY.get(name, name)
    if name not in _ML:
        return value.numpy()
    raw = (ctypes.c_char * value.tensor_size_in_bytes()).from_address(value.data_ptr())
    return np.frombuffer(bytes(raw), numpy_dtype(name)).reshape(value.shape())


def run_onnxruntime(model: bytes, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.log_severity_level = 4  # errors come back as exceptions
    session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    values = session.run_with_ort_values(names, {k: to_ort(v) for k, v in feeds.items()})
    return [from_ort(v) for v in values]


def run_reference(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    return [np.asarray(y) for y in ReferenceEvaluator(model).run(None, feeds)]


def check(model: onnx.ModelProto) -> str | None:
    try:
        onnx.checker.check_model(model, full_check=True)
        onnx.shape_inference.infer_shapes(model, strict_mode=True)
    except Exception as err:  # reported to the test, which fails on it
        return f"{type(err).__name__}: {err}"
    return None


def handle(request: dict) -> dict:
    model_bytes = request["model"]
    model = onnx.load_from_string(model_bytes)
    feeds = {k: unpack(v) for k, v in request["feeds"].items()}
    reply: dict = {"checker": check(model) if request.get("check", True) else None}
    for runtime, run in (
        ("onnxruntime", lambda: run_onnxruntime(model_bytes, feeds)),
        ("reference", lambda: run_reference(model, feeds)),
    ):
        try:
            reply[runtime] = [pack(y) for y in run()]
        except Exception as err:  # the test decides whether an error was expected
            reply[runtime] = f"{type(err).__name__}: {err}"
    reply["moe_onnx_imported"] = any(name == "moe_onnx" or name.startswith("moe_onnx.") for name in sys.modules)
    return reply


def main() -> None:
    # replies go to the original stdout; anything a library prints lands on stderr
    stdin, stdout = sys.stdin.buffer, os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    while True:
        try:
            request = pickle.load(stdin)
        except EOFError:
            return
        try:
            reply = handle(request)
        except Exception as err:  # a malformed request: reported, and the worker lives on
            reply = {"worker": f"{type(err).__name__}: {err}", "moe_onnx_imported": False}
        pickle.dump(reply, stdout)
        stdout.flush()


if __name__ == "__main__":
    main()
