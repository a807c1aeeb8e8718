"""``moe_onnx.InferenceSession``: onnxruntime's session for models with ``cann.moe`` nodes.

The session loads the model, answers onnxruntime's getters, and checks every feed against
the graph's declared inputs; an *executor* runs the graph. Executors share one small
protocol (:class:`Executor`), so a new way of running a model is one class:

* ``"split"`` (:class:`moe_onnx.runtime.split.SplitExecutor`): our nodes called in-process, each run
  of native nodes one onnxruntime session, tensors crossing by reference;
* ``"pyop"`` (:class:`moe_onnx.runtime.pyop_executor.PyOpExecutor`): one onnxruntime session in
  which our nodes are onnxruntime-extensions Python ops;
* ``"lowered"`` (:class:`moe_onnx.runtime.lowered_executor.LoweredExecutor`): our ops as their
  standard-ONNX bodies (:func:`moe_onnx.lower`), run by onnxruntime; only the collectives
  stay kernels. Not the checked path: refused inputs fail inside onnxruntime.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import onnx
import onnxruntime as ort

from ..custom_ops import TensorInfo, dtypes
from ..custom_ops.errors import BAD_DTYPE, MISSING_INPUT, FeedError
from .nodes import check_names

#: executor name -> "module:class", imported when first used
EXECUTORS = {
    "split": "moe_onnx.runtime.split:SplitExecutor",
    "pyop": "moe_onnx.runtime.pyop_executor:PyOpExecutor",
    "lowered": "moe_onnx.runtime.lowered_executor:LoweredExecutor",
}
#: the executors that run our kernels: the same bits, and refusals as MoeOpError
KERNEL_EXECUTORS = ("split", "pyop")


class Executor(Protocol):
    """What :class:`InferenceSession` needs of a way to run a model.

    Constructed as ``Executor(model, base_dir, sess_options, providers, context, **kwargs)``
    with the model as given (never modified), the folder its external data lives in (None
    if it has none), onnxruntime's options and providers, and the objects injected into
    kernels (e.g. ``communicator``). ``ort_session`` is the one onnxruntime session that runs
    the whole graph, if there is one (its API is then the session's).
    """

    ort_session: ort.InferenceSession | None

    def run(self, output_names: list[str], feeds: dict[str, np.ndarray], run_options) -> list[np.ndarray]:
        """The named outputs for feeds already checked against the declared inputs."""
        ...

    def get_providers(self) -> list[str]: ...


@dataclass(frozen=True)
class NodeArg:
    """A graph input or output as onnxruntime describes it: ``type`` is e.g. 'tensor(float)'."""

    name: str
    type: str
    shape: list[int | str | None]

    @staticmethod
    def of(value_info: onnx.ValueInfoProto) -> NodeArg:
        info = TensorInfo.from_type_proto(value_info.type)
        return NodeArg(value_info.name, info.type_string, list(info.shape or ()))


def load_model(model_or_path, load_external_data: bool = True) -> onnx.ModelProto:
    """A ModelProto from a path, serialized bytes, an ``onnx_ir.Model`` or a ModelProto (never
    modified)."""
    from ..converters.model_input import as_proto

    return as_proto(model_or_path, load_external_data=load_external_data)


def _load_small_external(model: onnx.ModelProto, base_dir: str, limit: int = 1 << 20) -> None:
    """Read external initializers below ``limit`` bytes into ``model`` (shape inference needs
    the values of shape constants); the weights stay in their files."""
    from onnx.external_data_helper import load_external_data_for_tensor

    for tensor in model.graph.initializer:
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        element = dtypes.numpy_dtype(dtypes.name_of_onnx(tensor.data_type) or "uint8")
        if int(np.prod(tensor.dims, dtype=np.int64)) * element.itemsize < limit:
            load_external_data_for_tensor(tensor, base_dir)
            tensor.data_location = onnx.TensorProto.DEFAULT
            del tensor.external_data[:]


def has_external_data(model: onnx.ModelProto) -> bool:
    return any(tensor.data_location == onnx.TensorProto.EXTERNAL for tensor in model.graph.initializer)


class InferenceSession:
    """A drop-in for ``onnxruntime.InferenceSession`` that runs ``cann.moe`` nodes.

    ``run()`` takes and returns numpy arrays of every dtype the ops support, bfloat16 and
    float8 as ml_dtypes arrays; an operator that refuses its inputs raises
    :class:`moe_onnx.MoeOpError` from ``run()``. Every executor gives the same bits.

    Args:
        model_or_path: path, serialized bytes, ``onnx.ModelProto`` or ``onnx_ir.Model``. From a path, external
            initializers are read by onnxruntime from their files (models over 2 GB work).
        sess_options: onnxruntime options; the custom-op library is registered on them.
        providers: defaults to ``["CPUExecutionProvider"]``.
        context: objects injected into kernels that need them (e.g. ``communicator``).
        executor: ``"split"`` (default), ``"pyop"`` or ``"lowered"``; see the module doc.
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
            raise ValueError(f"executor must be one of {tuple(EXECUTORS)}, got {executor!r}")
        from_file = isinstance(model_or_path, (str, os.PathLike))
        model = load_model(model_or_path, load_external_data=False)
        base_dir = os.path.dirname(os.path.abspath(os.fspath(model_or_path))) if from_file else None
        if base_dir is not None:
            _load_small_external(model, base_dir)
        elif has_external_data(model):
            raise ValueError("the model keeps initializers in external data: give InferenceSession its path")
        graph = model.graph
        check_names(graph)
        initializers = {init.name for init in graph.initializer}
        self.executor = executor
        self._declared = {vi.name: TensorInfo.from_type_proto(vi.type) for vi in graph.input}
        self._required = [vi.name for vi in graph.input if vi.name not in initializers]
        self._inputs = [NodeArg.of(vi) for vi in graph.input if vi.name not in initializers]  # as onnxruntime
        self._outputs = [NodeArg.of(vi) for vi in graph.output]
        module, _, name = EXECUTORS[executor].partition(":")
        executor_class = getattr(importlib.import_module(module), name)
        providers = list(providers or ["CPUExecutionProvider"])
        self._executor: Executor = executor_class(
            model, base_dir, sess_options, providers, dict(context or {}), **kwargs
        )

    def __getattr__(self, name):  # get_modelmeta, get_profiling_start_time_ns, ...
        if name.startswith("_") or name == "executor":  # not set yet (a failed __init__)
            raise AttributeError(name)
        ort_session = self._executor.ort_session
        if ort_session is None:
            raise AttributeError(
                f"InferenceSession(executor={self.executor!r}) has no '{name}': it runs several "
                "onnxruntime sessions; use executor='pyop' for the full API"
            )
        return getattr(ort_session, name)

    def get_inputs(self) -> list[NodeArg]:
        return list(self._inputs)

    def get_outputs(self) -> list[NodeArg]:
        return list(self._outputs)

    def get_providers(self) -> list[str]:
        return self._executor.get_providers()

    def run(
        self, output_names: Sequence[str] | None, input_feed: dict[str, Any], run_options: ort.RunOptions | None = None
    ) -> list[np.ndarray]:
        known = [o.name for o in self._outputs]
        names = list(output_names or known)
        unknown = [name for name in names if name not in known]
        if unknown:
            raise ValueError(f"unknown output(s) {unknown}; the model gives {known}")
        feeds = {name: dtypes.native(value) for name, value in input_feed.items()}
        for name, value in feeds.items():
            self._check_feed(name, value)
        missing = [name for name in self._required if name not in feeds]
        if missing:
            raise FeedError(f"missing required input(s) {missing}", MISSING_INPUT)
        outputs = self._executor.run(names, feeds, run_options)
        # an output over a feed's memory (a graph input returned, or passed through) is a
        # copy, as onnxruntime's own run() gives: changing it must not change the feed
        return [o.copy() if any(np.may_share_memory(o, f) for f in feeds.values()) else o for o in outputs]

    def _check_feed(self, name: str, value: np.ndarray) -> None:
        """What onnxruntime checks of a graph input: known name, element type, fixed dims."""
        declared = self._declared.get(name)
        if declared is None:
            raise FeedError(f"unknown input '{name}'; the model takes {list(self._declared)}")
        got = TensorInfo.of(value)
        if declared.dtype is not None and got.dtype != declared.dtype:
            raise FeedError(f"input '{name}' must be {declared.dtype}, got {value.dtype}", BAD_DTYPE)
        if declared.shape is not None:
            fixed = [d if isinstance(d, int) else None for d in declared.shape]
            if len(fixed) != value.ndim or any(d is not None and d != n for d, n in zip(fixed, value.shape)):
                raise FeedError(f"input '{name}' must have shape {list(declared.shape)}, got {list(value.shape)}")
