"""``moe_onnx.InferenceSession``: onnxruntime's session for models with ``cann.moe`` nodes."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from .custom_ops import dtypes
from .prepare import prepare_for_ort
from .pyops import NATIVE, bits_carrier, drop_context, new_context, session_options, take_error
from .split import SplitPlan, from_ort, node_arg


def load_model(model_or_path, load_external_data: bool = True) -> onnx.ModelProto:
    """A ModelProto from a path, serialized bytes or a ModelProto (never modified)."""
    if isinstance(model_or_path, onnx.ModelProto):
        return model_or_path
    if isinstance(model_or_path, (bytes, bytearray)):
        return onnx.load_from_string(bytes(model_or_path))
    return onnx.load(os.fspath(model_or_path), load_external_data=load_external_data)


def _load_small_external(model: onnx.ModelProto, base_dir: str, limit: int = 1 << 20) -> None:
    """Read external initializers below ``limit`` bytes into ``model`` (shape inference needs
    the values of shape constants); the weights stay in their files."""
    from onnx.external_data_helper import load_external_data_for_tensor

    for tensor in model.graph.initializer:
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        size = (
            int(np.prod(tensor.dims, dtype=np.int64))
            * dtypes.numpy_dtype(dtypes.name_of_onnx(tensor.data_type) or "uint8").itemsize
        )
        if size < limit:
            load_external_data_for_tensor(tensor, base_dir)
            tensor.data_location = onnx.TensorProto.DEFAULT
            del tensor.external_data[:]


def _external_locations(model: onnx.ModelProto) -> set[str]:
    return {
        entry.value
        for tensor in model.graph.initializer
        if tensor.data_location == onnx.TensorProto.EXTERNAL
        for entry in tensor.external_data
        if entry.key == "location"
    }


def _ort_session(prepared: onnx.ModelProto, base_dir: str | None, options, providers, kwargs):
    """An onnxruntime session of ``prepared``; external data is read where the model lives.

    onnxruntime resolves external data relative to the model file and refuses paths (or
    links) leading out of its folder, so a model whose weights are external (beyond
    protobuf's 2 GB too) is written, small, as a hidden file beside the original for the
    moment the session is created, then removed. Where that folder is read-only, the weights
    are read into memory instead (which needs a model under 2 GB).
    """
    if not _external_locations(prepared):
        return ort.InferenceSession(prepared.SerializeToString(), options, providers=providers, **kwargs)
    try:
        handle, path = tempfile.mkstemp(prefix=".moe_onnx_", suffix=".onnx", dir=base_dir)
    except OSError:
        onnx.load_external_data_for_model(prepared, base_dir)
        return ort.InferenceSession(prepared.SerializeToString(), options, providers=providers, **kwargs)
    try:
        with os.fdopen(handle, "wb") as f:
            f.write(prepared.SerializeToString())
        return ort.InferenceSession(path, options, providers=providers, **kwargs)
    finally:
        os.remove(path)


EXECUTORS = ("split", "pyop")
_SPINNING = "session.intra_op.allow_spinning"


def _without_spinning(options: ort.SessionOptions) -> ort.SessionOptions:
    """Segments alternate with our kernels (and other ranks' threads): onnxruntime's idle
    workers spinning after each segment take the cores those need (4 thread ranks of the EP
    layer: 640 -> 332 ms a forward). An explicit setting of the caller's is kept."""
    try:
        options.get_session_config_entry(_SPINNING)
    except RuntimeError:  # not set
        options.add_session_config_entry(_SPINNING, "0")
    return options


class InferenceSession:
    """A drop-in for ``onnxruntime.InferenceSession`` that runs ``cann.moe`` nodes.

    ``run()`` takes and returns numpy arrays of every dtype the ops support, bfloat16 and
    float8 as ml_dtypes arrays; an operator that refuses its inputs raises
    :class:`moe_onnx.MoeOpError` from ``run()``.

    Two executors give the same bits:

    * ``"split"`` (default): our nodes are called in-process and each run of native nodes
      is one onnxruntime session; tensors cross by reference (:mod:`moe_onnx.split`).
    * ``"pyop"``: one onnxruntime session in which our nodes are onnxruntime-extensions
      PyOps (:func:`moe_onnx.prepare_for_ort`); the extensions copy every input and output
      of those nodes once more, and all of onnxruntime's session API is available.

    Args:
        model_or_path: path, serialized bytes or ``onnx.ModelProto``. From a path, external
            initializers are read by onnxruntime from their files (models over 2 GB work).
        sess_options: onnxruntime options; the custom-op library is registered on them.
        providers: defaults to ``["CPUExecutionProvider"]``.
        context: objects injected into kernels that need them (e.g. ``communicator``).
        executor: ``"split"`` or ``"pyop"``.
    """

    def __init__(
        self,
        model_or_path,
        sess_options: ort.SessionOptions | None = None,
        providers: Sequence[str] | None = None,
        *,
        context: dict[str, Any] | None = None,
        executor: str = "split",
        **kwargs,
    ):
        if executor not in EXECUTORS:
            raise ValueError(f"executor must be one of {EXECUTORS}, got {executor!r}")
        from_file = isinstance(model_or_path, (str, os.PathLike))
        model = load_model(model_or_path, load_external_data=False)
        base_dir = os.path.dirname(os.path.abspath(os.fspath(model_or_path))) if from_file else None
        if base_dir is not None:
            _load_small_external(model, base_dir)
        elif _external_locations(model):
            raise ValueError("the model keeps initializers in external data: give InferenceSession its path")
        self.executor = executor
        self._objects = dict(context or {})
        providers = list(providers or ["CPUExecutionProvider"])
        self._providers = providers
        if executor == "split":
            options = _without_spinning(session_options(sess_options))
            self._plan = SplitPlan(model, lambda sub: _ort_session(sub, base_dir, options, providers, kwargs), base_dir)
            self._args = {vi.name: node_arg(vi) for vi in list(model.graph.input) + list(model.graph.output)}
            self._output_names = self._plan.output_names
            return
        self._context = new_context(**self._objects)  # where the PyOp hook finds them
        self._real = {
            vi.name: dtypes.name_of_onnx(vi.type.tensor_type.elem_type)
            for vi in list(model.graph.input) + list(model.graph.output)
        }
        prepared = prepare_for_ort(model, raw_io=True, context=self._context)
        self._carried = {
            vi.name: dtypes.name_of_onnx(vi.type.tensor_type.elem_type)
            for vi in list(prepared.graph.input) + list(prepared.graph.output)
        }
        self._session = _ort_session(prepared, base_dir, session_options(sess_options), providers, kwargs)
        self._output_names = [o.name for o in self._session.get_outputs()]

    def __del__(self):
        drop_context(getattr(self, "_context", 0))

    def __getattr__(self, name):  # get_modelmeta, get_profiling_start_time_ns, ...
        if name.startswith("_") or name == "executor":  # not set yet (a failed __init__)
            raise AttributeError(name)
        if self.__dict__.get("executor") == "split":
            raise AttributeError(
                f"InferenceSession(executor='split') has no '{name}': it runs "
                "several onnxruntime sessions; use executor='pyop' for the full API"
            )
        return getattr(self._session, name)

    def get_inputs(self) -> list:
        if self.executor == "split":
            return [self._args[name] for name in self._plan.required]  # as onnxruntime: no defaults
        return self._session.get_inputs()

    def get_outputs(self) -> list:
        if self.executor == "split":
            return [self._args[name] for name in self._plan.output_names]
        return self._session.get_outputs()

    def get_providers(self) -> list[str]:
        return self._providers if self.executor == "split" else self._session.get_providers()

    def run(
        self, output_names: Sequence[str] | None, input_feed: dict[str, Any], run_options: ort.RunOptions | None = None
    ) -> list[np.ndarray]:
        names = list(output_names or self._output_names)
        unknown = [name for name in names if name not in self._output_names]
        if unknown:
            raise ValueError(f"unknown output(s) {unknown}; the model gives {self._output_names}")
        if self.executor == "split":  # the plan checks the feeds against the declared inputs
            feeds = {name: np.asarray(value, order="C") for name, value in input_feed.items()}
            return self._plan.run(names, feeds, self._objects, run_options)
        feeds = {name: self._feed(name, value) for name, value in input_feed.items()}
        take_error(self._context)
        try:
            values = self._session.run_with_ort_values(names, feeds, run_options)
        except Exception as exc:
            parked = take_error(self._context)
            if parked is not None:
                raise parked from exc
            raise
        parked = take_error(self._context)
        if parked is not None:
            raise parked
        return [self._fetch(name, value) for name, value in zip(names, values)]

    def _feed(self, name: str, value) -> ort.OrtValue:
        array = np.asarray(value, order="C")  # (ascontiguousarray would make a 0-d array 1-d)
        real, carried = self._real.get(name), self._carried.get(name)
        if real is None or real in NATIVE:
            return ort.OrtValue.ortvalue_from_numpy(array)
        if array.dtype != dtypes.numpy_dtype(real):
            raise TypeError(f"input '{name}' must be {real}, got {array.dtype}")
        bits = array.view(dtypes.numpy_dtype(bits_carrier(real)))
        if carried != real:  # the prepared graph takes the bits themselves
            return ort.OrtValue.ortvalue_from_numpy(bits)
        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(bits, dtypes.onnx_type(real))

    def _fetch(self, name: str, value: ort.OrtValue) -> np.ndarray:
        real = self._real.get(name)
        if real is None or real in NATIVE:
            return value.numpy()
        if self._carried.get(name) != real:
            return value.numpy().view(dtypes.numpy_dtype(real))
        return from_ort(value)  # a typed non-native output (made by a native op)
