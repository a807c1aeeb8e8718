"""SIGINT and SIGTERM around work that must clean up after itself, or must not be cut.

Python runs signal handlers only in the main thread, and can install them only from there.
So both helpers act in the main thread and do nothing elsewhere: work run from another
thread gets the process's own dispositions (SIGTERM's default ends the process at once,
skipping any cleanup).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_INTERRUPTS = (signal.SIGINT, signal.SIGTERM)


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextmanager
def held(python_handlers_only: bool = False) -> Iterator[None]:
    """Hold SIGINT and SIGTERM until the block has finished, then deliver them.

    For short steps whose cleanup must not be cut off (a temp file that must be removed, two
    renames that go together). A held signal is re-raised with the handler that was in place
    before, so SIGINT still ends in KeyboardInterrupt and SIGTERM still ends the process.

    ``python_handlers_only``: hold only the signals whose handler is Python code (SIGINT's
    KeyboardInterrupt, a caller's own), for calls into C++ that call back into Python (the
    PyOp hook), where such a handler's exception would abort the process; a default or
    ignored disposition runs no Python and is left as it is.
    """
    if not _in_main_thread():
        yield
        return
    arrived: list[int] = []
    previous = {}
    for signum in _INTERRUPTS:
        handler = signal.getsignal(signum)
        if handler is None:  # a handler not installed from Python
            continue
        if python_handlers_only and not callable(handler):  # SIG_DFL, SIG_IGN
            continue
        previous[signum] = signal.signal(signum, lambda signum, _frame: arrived.append(signum))
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for late in dict.fromkeys(arrived):
            signal.raise_signal(late)


def _raise_interrupt(signum: int, _frame) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


@contextmanager
def terminate_interrupts() -> Iterator[None]:
    """Within the block SIGTERM raises KeyboardInterrupt, as SIGINT does, so ``finally``
    clauses and ``except KeyboardInterrupt`` cleanups run for both."""
    if not _in_main_thread() or signal.getsignal(signal.SIGTERM) is None:
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class Deferral:
    """The signals that arrived while :func:`deferred` held them; :meth:`check` raises the
    first as KeyboardInterrupt (its name as the message: ``SIGINT``, ``SIGTERM``)."""

    def __init__(self) -> None:
        self.arrived: list[int] = []

    def _record(self, signum: int, _frame) -> None:
        self.arrived.append(signum)

    def check(self) -> None:
        if self.arrived:
            raise KeyboardInterrupt(signal.Signals(self.arrived[0]).name)


@contextmanager
def deferred() -> Iterator[Deferral]:
    """SIGINT and SIGTERM are only recorded within the block; the block calls
    :meth:`Deferral.check` where stopping is safe, and leaving the block raises a recorded one.

    For work whose Python code is called back from C++ (onnxruntime-extensions' PyOp hook):
    an exception raised there by a signal handler crosses C++ and aborts the process
    (``terminate called after throwing an instance of 'pybind11::error_already_set'``).
    The recording handler cannot raise, so nothing crosses. Outside the main thread it only
    yields (signals go to the main thread).
    """
    deferral = Deferral()
    if not _in_main_thread():
        yield deferral
        return
    previous = {}
    for signum in _INTERRUPTS:
        if signal.getsignal(signum) is not None:
            previous[signum] = signal.signal(signum, deferral._record)
    try:
        yield deferral
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    deferral.check()
