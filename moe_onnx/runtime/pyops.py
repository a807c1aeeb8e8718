"""The onnxruntime-extensions boundary: PyOp registration and the invocation hook.

Facts this module is built around (SPEC section 2, re-measured with extensions 0.15.2):

* A PyOp has fixed input/output types, so each (op, carrier types) signature is registered
  once, lazily, by :func:`pyop_for`.
* PyOps added after ``register_custom_ops_library`` are invisible to it, and adding one to a
  domain that a library registration already saw crashes session creation. So once options
  have been made (:func:`session_options`), new signatures go to a fresh domain.
* A Python exception in a PyOp, or an output whose size disagrees with its shape, kills the
  process. :func:`invoke` therefore never raises: errors are parked per (context, thread)
  and re-raised by :class:`moe_onnx.InferenceSession` after ``run()``.
* float16/bfloat16/float8 cannot cross. Tensors of those types cross either as their bits
  (``uint16``/``uint8`` views, exact) or as float32 values (for tensors shared with native
  ops); the kernel always sees the real dtype, recorded in the node's ``config`` attribute.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
import onnxruntime as ort

from ..custom_ops import OpDef, buffers, dtypes

log = logging.getLogger("moe_onnx")

ORT_DOMAIN = "cann.moe.ort"

#: element types a PyOp can carry as they are (the name of each one's ``PyCustomOpDef`` type)
NATIVE = {
    "float32": "dt_float",
    "float64": "dt_double",
    "int8": "dt_int8",
    "uint8": "dt_uint8",
    "int16": "dt_int16",
    "uint16": "dt_uint16",
    "int32": "dt_int32",
    "int64": "dt_int64",
    "bool": "dt_bool",
}


@lru_cache(maxsize=1)
def extensions() -> tuple[Any, Any]:
    """``(onnxruntime_extensions, onnxruntime_extensions._ocos)``, imported on first use.

    Not at ``import moe_onnx``: the package imports torch whenever torch is installed (and
    sets PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=python for child processes), which only the
    pyop executor should pay for."""
    import onnxruntime_extensions
    from onnxruntime_extensions import _ocos

    return onnxruntime_extensions, _ocos


#: carrier of the bits of a non-native type, by item size
BITS = {1: "uint8", 2: "uint16"}


def bits_carrier(dtype: str) -> str:
    """The unsigned integer type that carries ``dtype``'s bits across the boundary."""
    return BITS[dtypes.numpy_dtype(dtype).itemsize]


@dataclass(frozen=True)
class _Entry:
    op: OpDef
    output_carriers: tuple[np.dtype, ...]
    #: what the hook returns when even packing empty outputs failed: nothing left to go wrong
    failed: tuple


class _Registry:
    """Signatures registered with onnxruntime-extensions, kept alive for the process."""

    def __init__(self):
        # held by every call into the extensions' C++ registry and by session creation
        # (moe_onnx.runtime.ort_session.create): a PyOp added while another thread creates a session
        # crashed the process
        self.lock = threading.RLock()
        self.generation = 0
        self.sealed = False  # a library registration has seen the current domain
        self.by_key: dict[tuple, tuple[str, str]] = {}
        self.entries: dict[int, _Entry] = {}
        self.defs: list[Any] = []  # PyCustomOpDef objects: the C++ side keeps raw pointers to these

    def pyop_for(self, op: OpDef, input_carriers: tuple[str, ...], output_carriers: tuple[str, ...]) -> tuple[str, str]:
        key = (op.name, input_carriers, output_carriers)
        with self.lock:
            if key in self.by_key:
                return self.by_key[key]
            if self.sealed:
                self.generation += 1
                self.sealed = False
            domain = ORT_DOMAIN if self.generation == 0 else f"{ORT_DOMAIN}.{self.generation}"
            op_type = "__".join((op.name, "_".join(input_carriers), "_".join(output_carriers)))
            package, ocos = extensions()
            py_op = package.PyCustomOpDef
            native = py_op()
            native.op_type = f"{domain}::{op_type}"
            native.obj_id = len(self.defs) + 1
            native.input_types = [getattr(py_op, NATIVE[t]) for t in input_carriers]
            native.output_types = [getattr(py_op, NATIVE[t]) for t in output_carriers]
            native.attrs = {"config": py_op.dt_string}
            _install_hook()
            ocos.add_custom_op(native)
            self.defs.append(native)
            carriers = tuple(np.dtype(dtypes.numpy_dtype(t)) for t in output_carriers)
            failed = (native.obj_id, *[part for c in carriers for part in ((0,), np.empty(0, c))])
            self.entries[native.obj_id] = _Entry(op, carriers, failed)
            self.by_key[key] = (domain, op_type)
            return domain, op_type

    def seal(self) -> None:
        with self.lock:
            self.sealed = True


REGISTRY = _Registry()


def pyop_for(op: OpDef, input_carriers, output_carriers) -> tuple[str, str]:
    """(domain, op_type) of the PyOp running ``op`` with these carrier types."""
    return REGISTRY.pyop_for(op, tuple(input_carriers), tuple(output_carriers))


def session_options(options: ort.SessionOptions | None = None) -> ort.SessionOptions:
    """Session options that can run models made by :func:`moe_onnx.prepare_for_ort`.

    Prepare the model first: signatures registered later need new options.
    """
    options = options or ort.SessionOptions()
    with REGISTRY.lock:
        seen = _registered_generation(options)
        if seen is None:
            options.register_custom_ops_library(extensions()[0].get_library_path())
            options.add_session_config_entry(_REGISTERED, str(REGISTRY.generation))
        elif seen != REGISTRY.generation:  # registering the library twice on one options fails
            raise ValueError(
                "these SessionOptions registered the onnxruntime-extensions library before this "
                "model's Python ops existed; pass new SessionOptions (or None)"
            )
        REGISTRY.seal()
    # Sequential execution runs every kernel on the thread that called run(), which is
    # where errors and injected context are looked up.
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    return options


#: the session config entry that marks options this module registered the library on (and
#: the registry generation they can see)
_REGISTERED = "moe_onnx.extensions_generation"


def _registered_generation(options: ort.SessionOptions) -> int | None:
    try:
        return int(options.get_session_config_entry(_REGISTERED))
    except RuntimeError:  # not set
        return None


# per-session context: injected objects and the first error of the current run
_CONTEXTS: dict[int, dict[str, Any]] = {0: {}}
_ERRORS: dict[tuple[int, int], BaseException] = {}
_next_context = iter(range(1, 2**62))


def new_context(**objects) -> int:
    """A context id for one session; ``objects`` are injected into kernels that need them."""
    context = next(_next_context)
    _CONTEXTS[context] = objects
    return context


def drop_context(context: int) -> None:
    """Forget a session's context: its injected objects and any error still parked for it."""
    _CONTEXTS.pop(context, None)
    for key in [key for key in _ERRORS if key[0] == context]:
        _ERRORS.pop(key, None)


def take_error(context: int) -> BaseException | None:
    """The first error a kernel parked during this thread's run, cleared."""
    return _ERRORS.pop((context, threading.get_ident()), None)


@lru_cache(maxsize=4096)
def _config(text: str) -> dict[str, Any]:
    config = json.loads(text)
    config["input_dtypes"] = [None if t is None else dtypes.numpy_dtype(t) for t in config["inputs"]]
    config["wanted"] = {name for name, t in zip(config["output_names"], config["outputs"]) if t}
    return config


def _to_dtype(array: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Carrier -> real dtype or back: a bits view when sizes match, a value cast otherwise."""
    if array.dtype == dtype:
        return array
    if array.dtype.itemsize == dtype.itemsize and (array.dtype.kind == "u" or dtype.kind == "u"):
        return array.view(dtype)
    return array.astype(dtype)


_hook_installed = False


def _install_hook() -> None:
    """Route PyOp calls through :func:`invoke` (once, when the first signature registers)."""
    global _hook_installed
    if not _hook_installed:
        extensions()[0].PyCustomOpDef.install_hooker(invoke)
        _hook_installed = True


@contextmanager
def hook(replacement) -> Iterator[None]:
    """Route PyOp calls through ``replacement(k_id, feed, attributes)`` for a while (e.g. the
    benchmark's stock output path, which wraps :func:`invoke`)."""
    _install_hook()
    py_op = extensions()[0].PyCustomOpDef
    py_op.install_hooker(replacement)
    try:
        yield
    finally:
        py_op.install_hooker(invoke)


def invoke(k_id: int, feed: tuple, attributes: dict) -> tuple:
    """The invocation hook: run one node's kernel. Never raises (see module doc)."""
    entry = REGISTRY.entries.get(k_id)
    if entry is None:  # a PyOp somebody else registered with onnx_op
        return extensions()[1]._on_pyop_invocation(k_id, feed, attributes)
    try:
        config = _config(attributes["config"])
        inputs = [None if dt is None else _to_dtype(x, dt) for x, dt in zip(feed, config["input_dtypes"])]
        context = _CONTEXTS.get(config["context"], {})
        # onnxruntime copies the outputs before this thread's next kernel: recycle them
        with buffers.recycled_outputs():
            outputs = entry.op(
                *inputs, node_name=config["node"], wanted=config["wanted"], context=context, **config["attrs"]
            )
        return _pack(k_id, entry, list(outputs))
    except BaseException as exc:  # noqa: BLE001 - must not reach C++ (it aborts the process)
        _park(attributes, exc)
        try:
            return _pack(k_id, entry, _empty_outputs(entry, attributes))
        except BaseException:  # noqa: BLE001 - nor may the error path itself raise
            return entry.failed


def _empty_outputs(entry: _Entry, attributes: dict) -> list[np.ndarray]:
    """Zero-size outputs of the promised ranks, returned when a kernel failed; rank 1 where
    the config cannot say (it may have been edited in the model file)."""
    try:
        ranks = _config(attributes["config"])["output_ranks"]
    except Exception:  # noqa: BLE001 - an unreadable config still must not abort
        ranks = None
    count = len(entry.output_carriers)
    if not (isinstance(ranks, list) and len(ranks) == count and all(type(r) is int and 0 <= r <= 32 for r in ranks)):
        ranks = [1] * count
    return [np.empty((0,) * rank, carrier) for rank, carrier in zip(ranks, entry.output_carriers)]


def _park(attributes: dict, exc: BaseException) -> None:
    """Keep the first error of this run for InferenceSession.run() to raise."""
    try:
        context = int(json.loads(attributes["config"])["context"])
    except Exception:  # noqa: BLE001 - an unreadable config still must not abort
        context = 0
    if context == 0:  # a plain onnxruntime session: nobody will collect it, so say it
        log.error("%s", exc)
        return
    _ERRORS.setdefault((context, threading.get_ident()), exc)


def _pack(k_id: int, entry: _Entry, outputs: list) -> tuple:
    """(k_id, shape, array, ...) with every array C-contiguous in its carrier dtype."""
    packed: list[Any] = [k_id]
    for i, carrier in enumerate(entry.output_carriers):
        value = outputs[i] if i < len(outputs) else None
        if value is None:
            value = np.empty(0, carrier)
        value = np.ascontiguousarray(_to_dtype(value, carrier))
        packed += [value.shape, value]
    return tuple(packed)
