"""The pyop executor: one onnxruntime session, our nodes as onnxruntime-extensions Python ops.

The model is rewritten by :func:`moe_onnx.prepare_for_ort` (non-native element types cross
as their bits); kernel errors are parked by the invocation hook and raised from ``run()``.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort

from ..custom_ops import TensorInfo, dtypes
from ..custom_ops.model_types import value_types
from ..custom_ops.tensor_info import UNKNOWN
from ..interrupts import held
from . import ort_session
from .ort_session import from_ort
from .prepare import prepare_for_ort
from .pyops import NATIVE, bits_carrier, drop_context, new_context, session_options, take_error


def _declared_types(graph: onnx.GraphProto) -> dict[str, str | None]:
    """Graph input/output name -> its declared element type name."""
    return {vi.name: TensorInfo.from_type_proto(vi.type).dtype for vi in list(graph.input) + list(graph.output)}


class PyOpExecutor:
    """One onnxruntime session on the prepared model (see the module doc)."""

    def __init__(self, model: onnx.ModelProto, base_dir: str | None, sess_options, providers, context, **kwargs):
        self._context = new_context(**context)  # where the PyOp hook finds the injected objects
        types = value_types(model)
        # a graph output may be declared without its type: inference knows it
        self._real = {name: types.get(name, UNKNOWN).dtype for name in _declared_types(model.graph)}
        prepared = prepare_for_ort(model, raw_io=True, context=self._context, types=types)
        self._carried = _declared_types(prepared.graph)
        options = session_options(sess_options)
        if sess_options is None:
            # a refused input leaves zero-size outputs, which onnxruntime warns about once per
            # output beside the MoeOpError run() raises; options a caller passes keep their level
            options.log_severity_level = 3
        self.ort_session = ort_session.create(prepared, base_dir, options, providers, **kwargs)

    def __del__(self):
        drop_context(getattr(self, "_context", 0))

    def get_providers(self) -> list[str]:
        return self.ort_session.get_providers()

    def run(self, output_names: list[str], feeds: dict[str, np.ndarray], run_options) -> list[np.ndarray]:
        values = {name: self._feed(name, value) for name, value in feeds.items()}
        take_error(self._context)
        try:
            # Ctrl-C waits for the call: raised inside the PyOp hook, KeyboardInterrupt would
            # cross onnxruntime's C++ and abort the process
            with held(python_handlers_only=True):
                results = self.ort_session.run_with_ort_values(output_names, values, run_options)
        except Exception as exc:
            parked = take_error(self._context)
            if parked is not None:
                raise parked from exc
            raise
        parked = take_error(self._context)
        if parked is not None:
            raise parked
        return [self._fetch(name, value) for name, value in zip(output_names, results)]

    def _feed(self, name: str, array: np.ndarray) -> ort.OrtValue:
        real, carried = self._real.get(name), self._carried.get(name)
        if real is None or real in NATIVE:
            return ort.OrtValue.ortvalue_from_numpy(array)
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
