"""One call from a torch module to an ONNX model with ``cann.moe`` nodes."""

from __future__ import annotations

import contextlib
import inspect
import linecache
import logging
import os
import re
import sys
import warnings
from collections.abc import Iterator
from types import FrameType

import torch

from .translations import translation_table


def export(module: torch.nn.Module, args: tuple, path: str | os.PathLike, *, dynamic_shapes=None, **kwargs):
    """Export ``module(*args)`` with ``torch.onnx.export(dynamo=True)`` and our translations.

    Args:
        module: the module; ``moe_onnx.torch`` ops, ``torch.distributed`` collectives (traced
            as torch's functional collectives) and stable sorts become ``cann.moe`` / ONNX nodes.
        args: example inputs.
        path: where the model is written (``moe_onnx.InferenceSession`` and ``moe-onnx run``
            take it as it is).
        dynamic_shapes: as for ``torch.export``, e.g. ``{"x": {0: torch.export.Dim("T")}}``
            for a dynamic token count.
        kwargs: passed on to ``torch.onnx.export`` (``custom_translation_table`` entries are
            added to ours).
    Returns:
        The ``torch.onnx.ONNXProgram``.
    """
    table = translation_table()
    table.update(kwargs.pop("custom_translation_table", None) or {})
    kwargs.setdefault("verbose", False)
    with _quiet_exporter():
        program = torch.onnx.export(
            module, args, dynamo=True, dynamic_shapes=dynamic_shapes, custom_translation_table=table, **kwargs
        )
    assert program is not None  # dynamo=True always returns the program
    static = static_where_dynamic(program, module, args, dynamic_shapes)
    if static:
        sites = specialisation_sites(module, args, dynamic_shapes, kwargs.get("kwargs"))
        where = "; ".join(sites) if sites else "torch did not say where"
        raise StaticExportError(
            f"export: {', '.join(static)} asked to be dynamic but the exported model fixes it "
            "(an op or argument specialised the size: a Python int computed from it, a .tolist(), "
            f"a size passed where a constant goes): {where}; the model was not written"
        )
    program.save(os.fspath(path))
    return program


#: torch's own notices that say nothing about the user's model: the exporter's registry says
#: once per torchvision op that torchvision is absent, and torch's pytree warns of its own
#: deprecated LeafSpec while exporting (torch 2.13)
_REGISTRY_LOGGER = "torch.onnx._internal.exporter._registration"
_PYTREE_NOTICE = r"`isinstance\(treespec, LeafSpec\)` is deprecated"


@contextlib.contextmanager
def _quiet_exporter() -> Iterator[None]:
    """Hold back those notices (only those) while exporting."""
    logger = logging.getLogger(_REGISTRY_LOGGER)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_PYTREE_NOTICE, category=FutureWarning)
            yield
    finally:
        logger.setLevel(level)


class StaticExportError(ValueError):
    """``torch.onnx.export`` returned a model whose input dims are fixed where ``dynamic_shapes``
    asked for dynamic ones (it can fall back to a static export in silence)."""


def _asked_dynamic(spec) -> list[int]:
    """The dims of one input's ``dynamic_shapes`` entry that are asked to be dynamic (a ``Dim``,
    ``Dim.AUTO`` / ``DYNAMIC``, or a name)."""
    if isinstance(spec, dict):
        return [int(d) for d, v in spec.items() if v is not None and v is not torch.export.Dim.STATIC]
    if isinstance(spec, (list, tuple)):
        return [d for d, v in enumerate(spec) if v is not None and v is not torch.export.Dim.STATIC]
    return []


def static_where_dynamic(program, module: torch.nn.Module, args: tuple, dynamic_shapes) -> list[str]:
    """``"input NAME dim D"`` for each dim ``dynamic_shapes`` asks to be dynamic that the exported
    model's graph input fixes. Inputs are matched by position when every argument is one
    tensor (nested arguments are not checked)."""
    if dynamic_shapes is None or not all(isinstance(a, torch.Tensor) for a in args):
        return []
    names = list(inspect.signature(module.forward).bind(*args).arguments)
    if isinstance(dynamic_shapes, dict):
        specs = [dynamic_shapes.get(name) for name in names]
    else:
        specs = list(dynamic_shapes) + [None] * (len(args) - len(dynamic_shapes))
    inputs = list(program.model.graph.inputs)
    if len(inputs) != len(args):
        return []
    found = []
    for name, spec, value in zip(names, specs, inputs):
        for dim in _asked_dynamic(spec):
            if value.shape is not None and dim < len(value.shape) and isinstance(value.shape[dim], int):
                found.append(f"input {name} dim {dim} (exported as {value.shape[dim]})")
    return found


# --- where the size was fixed ------------------------------------------------------------

#: torch's ShapeEnv says each guard it adds on this logger (INFO, ``TORCH_LOGS=dynamic``)
_SHAPES_LOGGER = "torch.fx.experimental.symbolic_shapes"
#: a guard that fixes a size: ``Eq(s77, 9)``, ``Eq(2*s77, 18)``
_FIXES_A_SIZE = re.compile(r"^Eq\((?P<size>.*\bs\d+\b.*), (?P<value>-?\d+)\)$")
#: torch's name of an input size, ``L['x'].size()[0]``
_SOURCE = re.compile(r"L\['(?P<name>\w+)'\]\.size\(\)\[(?P<dim>\d+)\]")
#: our package's folder, and the frames that are not the caller's code: torch's, ours, logging's
_OURS = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_NOT_USER = (_OURS, *(os.path.dirname(str(m.__file__)) + os.sep for m in (torch, logging)), str(contextlib.__file__))


def specialisation_sites(module: torch.nn.Module, args: tuple, dynamic_shapes, kwargs=None) -> list[str]:
    """Where tracing ``module(*args)`` fixed a dynamic size, as torch says it: one line per guard
    that equates a size with a constant (``Eq(s77, 9)``), naming the ``cann.moe`` op, its
    argument and the torch_npu name when the guard was added inside one, and the caller's line;
    or the refusal the trace raised. Traces once more with ``torch.export.export(strict=False)``,
    the exporter's first strategy (the refusal behind a static model, which ``torch.onnx.export``
    does not pass on)."""
    recorder = _GuardRecorder()
    error = None
    oblivious = torch.fx.experimental._config.patch(backed_size_oblivious=True)  # type: ignore[attr-defined]
    with recorder.installed(), oblivious:  # as the exporter's strategy traces
        try:
            torch.export.export(module, args, kwargs=kwargs, dynamic_shapes=dynamic_shapes, strict=False)
        except Exception as err:  # noqa: BLE001 - what the trace raised is the answer, not a failure here
            if not isinstance(err, torch._dynamo.exc.UserError):  # torch's constraint report says no place
                error = f"{type(err).__name__}: {str(err).splitlines()[0]} {_place(_innermost(err.__traceback__))}"
    return ([error] if error else []) + list(dict.fromkeys(recorder.sites))


class _GuardRecorder(logging.Handler):
    """Records, for each guard torch adds that fixes a size, where it was added (the guard's
    Python stack, read while torch logs it)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.sites: list[str] = []
        self.sizes: dict[str, str] = {}  # symbol -> the input size it stands for ("x.shape[0]")

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """Listen on ShapeEnv's logger; its INFO records are held back from torch's own handlers
        unless the user asked for them."""
        logger = logging.getLogger(_SHAPES_LOGGER)
        level, propagate = logger.level, logger.propagate
        if not logger.isEnabledFor(logging.INFO):
            logger.setLevel(logging.INFO)
            logger.propagate = False
        logger.addHandler(self)
        try:
            yield
        finally:
            logger.removeHandler(self)
            logger.setLevel(level)
            logger.propagate = propagate

    def emit(self, record: logging.LogRecord) -> None:
        args = record.args if isinstance(record.args, tuple) else ()
        if str(record.msg).startswith("create_symbol %s = %s for %s") and len(args) >= 3:
            self.sizes[str(args[0])] = _SOURCE.sub(r"\g<name>.shape[\g<dim>]", str(args[2]))
            return
        if "[guard added]" not in str(record.msg) or len(args) < 2:
            return
        match = _FIXES_A_SIZE.match(str(args[1]))
        frame = sys._getframe(1)
        if match is None or _solving(frame):
            return
        size = re.sub(r"\bs\d+\b", lambda m: self.sizes.get(m[0], m[0]), match["size"])
        self.sites.append(f"{size} == {match['value']} {_place(frame)}")


def _solving(frame: FrameType | None) -> bool:
    """Is torch unifying the sizes after the trace (a guard that says nothing about a line of
    the module: ``Eq(s95, s77)`` solved with the other inputs' sizes)?"""
    while frame is not None:
        if frame.f_code.co_name.startswith("produce_guards"):
            return True
        frame = frame.f_back
    return False


def _place(innermost: FrameType | None) -> str:
    """``"in cann.moe::Op argument a (torch_npu.name) at file:line in f: source"`` for the stack
    under ``innermost``: the innermost ``OpDef`` (a frame of ours with a local ``op``), the
    argument it was reading (a local ``name`` below it that is one of the op's inputs or
    attributes), the torch_npu name (a local ``where``, the stand-ins' check) and the innermost
    frame of the caller's code."""
    frames = []
    while innermost is not None:
        frames.append(innermost)
        innermost = innermost.f_back
    ours = [f for f in frames if f.f_code.co_filename.startswith(_OURS)]
    at = next((i for i, f in enumerate(frames) if f in ours and _is_op(f.f_locals.get("op"))), None)
    parts = []
    if at is not None:
        op = frames[at].f_locals["op"]
        names = set(op.input_names) | {a.name for a in op.attrs}
        argument = next((f.f_locals["name"] for f in frames[: at + 1] if f.f_locals.get("name") in names), None)
        parts.append(f"in cann.moe::{op.name}" + (f" argument {argument}" if argument else ""))
    api = next((f.f_locals["where"] for f in ours if isinstance(f.f_locals.get("where"), str)), None)
    if api is not None:
        parts.append(f"({api})")
    user = next((f for f in frames if not f.f_code.co_filename.startswith(_NOT_USER)), None)
    if user is not None:
        line = linecache.getline(user.f_code.co_filename, user.f_lineno).strip()
        parts.append(f"at {user.f_code.co_filename}:{user.f_lineno} in {user.f_code.co_name}: {line}")
    return " ".join(parts) or "(no frame outside torch)"


def _innermost(tb) -> FrameType | None:
    """The frame a traceback ends in (its ``f_back`` chain is the whole stack)."""
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return None if tb is None else tb.tb_frame


def _is_op(value) -> bool:
    """An ``OpDef`` (by what it has: this module does not import the operator definitions)."""
    return hasattr(value, "input_names") and hasattr(value, "attrs") and hasattr(value, "name")
