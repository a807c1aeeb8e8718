"""Splitting a big kernel call over a few threads, and the row gather every op uses."""

from __future__ import annotations

import functools
import math
import os
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from . import buffers

#: an op moving fewer bytes than this runs on the calling thread only (a part per this many
#: bytes, up to the workers). 16 MiB until the helpers polled for calls (waking a blocked one
#: took 50-80 us); at 4 MiB the layer's SwiGlu and combine of 4-16 MB take both cores (one core
#: reads ~8 GB/s from memory, two ~15): the qwen3-like layer at T = 512 0.96x the time, the
#: mixtral-like 0.98x, T = 64-128 and the deepseek-like 0.97-1.01x (docs/bench.md, "twelfth step")
_PARALLEL_MIN_BYTES = 4 << 20
_MAX_WORKERS = 4


@functools.cache
def _cpu_count() -> int:
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity else (os.cpu_count() or 1)


def for_row_ranges(work: Callable[[int, int], None], rows: int, row_bytes: int) -> None:
    """Call ``work(start, stop)`` on contiguous ranges covering ``[0, rows)``.

    Large calls are split over a few threads: numpy's copies and ufuncs and the compiled
    loops of :mod:`.fused` release the GIL, and one core alone can neither saturate memory
    bandwidth nor page in a fresh output. Each output row is computed by one thread alone,
    so the result does not depend on the split.
    """
    parts = int(min(workers(), max(1, rows * row_bytes // _PARALLEL_MIN_BYTES)))
    if parts <= 1:
        work(0, rows)
        return
    run_ranges(work, np.linspace(0, rows, parts + 1).astype(np.int64))


def workers() -> int:
    """The most threads one kernel call uses."""
    return min(_cpu_count(), _MAX_WORKERS)


# The helper threads live for the process: starting a thread per call cost ~110 us here. When
# a call ends they poll for the next one for a short while (:mod:`.spin`) before they block, and
# the caller polls for the helpers' end the same way: on this virtual machine a blocked thread's
# core is halted and waking it took 50-80 us at each end of a call, a third of a decode-size
# GEMM (whose two threads ran at 33 GB/s where a polling pair runs at 47-56).
#: how long a helper polls for the next call before it blocks, and the caller for the helpers' end
_HELPER_POLL_SECONDS = 300e-6
_CALLER_POLL_SECONDS = 1e-3
#: microseconds a helper polls (the caller: that, at least, up to 1 ms); 0: block at once (a
#: machine whose cores other processes need more than this one's decode latency)
POLL_VARIABLE = "MOE_ONNX_HELPER_POLL_US"


def _poll_seconds() -> tuple[float, float]:
    """(helper, caller) poll times: _HELPER_POLL_SECONDS and _CALLER_POLL_SECONDS, or
    $MOE_ONNX_HELPER_POLL_US microseconds for the helper (0 stops the caller's poll too)."""
    configured = os.environ.get(POLL_VARIABLE, "").strip()
    if not configured:
        return _HELPER_POLL_SECONDS, _CALLER_POLL_SECONDS
    try:
        helper = float(configured) * 1e-6
    except ValueError:
        helper = -1.0
    if not (math.isfinite(helper) and helper >= 0):
        raise ValueError(f"{POLL_VARIABLE} must be a number of microseconds >= 0 (e.g. 0 or 300), got {configured!r}")
    return helper, (0.0 if helper == 0 else max(helper, _CALLER_POLL_SECONDS))


#: what the compiled server (fused_loops.serve_compiled_calls) returns for: no call for a
#: while, a Python call, a call posted from the helper's own core (the caller's: the helper
#: moves off it, then joins)
IDLE, PYTHON_CALL, ON_CALLERS_CORE = 0, 1, 2

_pool: _Helpers | None = None
_pool_lock = threading.Lock()
_on_helper = threading.local()  # set on the helpers: a range they run runs its own ranges inline

# The helpers' shared int64 counters. A Python call (run_ranges) is posted by numbering it in
# POSTED; the helpers join it in Python, and the last to leave writes its number in ENDED. A
# compiled call (run_compiled) is posted the same way with its number also in COMPILED and
# OPEN: a helper polling in the compiled server (register_compiled_server) runs its shares
# without returning to Python, counted in INSIDE; NEXT hands out the shares and SEAT each
# thread's scratch (the caller has seat 0). HOLD, set while a compiled caller may post further
# calls itself (no notify reaches a blocked helper from compiled code), keeps the helpers polling.
POSTED, ENDED, COMPILED, OPEN, NEXT, INSIDE, SEAT, HOLD = range(8)
#: the core the caller of the last call ran on as it posted it, or -1
CALLER_CPU = 8
#: int64 slots of a compiled call's descriptor (what the server reads)
DESCRIPTOR_SLOTS = 64

#: (server, caller): the compiled loops that serve compiled calls on a helper and run one on
#: the caller (see register_compiled_server); None until the kernels that post them are loaded
_compiled: tuple[Callable, Callable] | None = None


def register_compiled_server(server: Callable, caller: Callable) -> None:
    """The compiled loops behind :func:`run_compiled` (:mod:`.fused_loops` registers them when
    it loads: the helpers run its kernels without taking the GIL). ``server(counters,
    descriptor, seen, polls, moved_for) -> (seen, why)`` polls for calls numbered after ``seen``,
    runs compiled ones' shares, and returns at a Python call, at a call posted from the
    helper's own core (it moves off, once per call: ``moved_for``) or after ``polls`` idle polls;
    ``caller(counters, descriptor, polls) -> ended`` runs the caller's shares, closes the call
    and polls for the helpers inside to leave."""
    global _compiled
    _compiled = (server, caller)


class _Call:
    """One run_ranges call: its ranges, handed out one at a time to the caller and the helpers
    that join before the caller has taken the last one."""

    def __init__(self, number: int, work: Callable[[int, int], None], ranges: list[tuple[int, int]], seats: int):
        self.number, self.work, self.left = number, work, iter(ranges)
        self.lock = threading.Lock()
        self.seats = seats  # helpers that may still join
        self.inside = 0  # helpers in it now
        self.closed = False  # no helper joins any more
        self.stopped = False  # an error: no range is handed out any more
        self.errors: list[BaseException] = []

    def take_ranges(self) -> None:
        """Run ranges until none is left (or an error stopped the handing out); an error is
        kept for the caller, which raises the first."""
        while True:
            with self.lock:
                taken = None if self.stopped else next(self.left, None)
            if taken is None:
                return
            try:
                self.work(*taken)
            except BaseException as exc:  # noqa: BLE001 - raised by the caller, after every range ended
                with self.lock:
                    self.stopped = True
                    self.errors.append(exc)
                return

    def join(self) -> bool:
        """Take a seat (a helper), unless the call is closed or full."""
        with self.lock:
            if self.closed or self.seats == 0:
                return False
            self.seats, self.inside = self.seats - 1, self.inside + 1
            return True

    def leave(self) -> bool:
        """Leave a seat; whether the call is over (closed, nobody inside)."""
        with self.lock:
            self.inside -= 1
            return self.closed and self.inside == 0

    def close(self) -> bool:
        """No more helpers (the caller has run out of ranges); whether some are still inside."""
        with self.lock:
            self.closed = True
            return self.inside > 0


class _Helpers:
    """The process's helper threads and the one call they serve at a time. ``_counters``
    holds the number of the last call posted and of the last call whose helpers all left:
    the threads poll them (:mod:`.spin`), then wait on ``_changed``."""

    def __init__(self) -> None:
        from . import spin

        self._spin = spin
        self._counters = np.zeros(9, np.int64)  # POSTED, ENDED, COMPILED, ...
        self._counters[CALLER_CPU] = -1
        self._descriptor = np.zeros(DESCRIPTOR_SLOTS, np.int64)
        self._changed = threading.Condition()
        self._call: _Call | None = None
        self._busy = threading.Lock()  # one call at a time; another caller runs its ranges inline
        self._threads: list[threading.Thread] = []
        per_second = spin.polls_per_second()
        helper_seconds, caller_seconds = _poll_seconds()
        self._helper_polls = int(per_second * helper_seconds)
        self._caller_polls = int(per_second * caller_seconds)

    def ensure(self, count: int) -> None:
        """At least ``count`` helper threads running."""
        while len(self._threads) < count:
            thread = threading.Thread(target=self._serve, name=f"moe-onnx-kernel_{len(self._threads)}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def _wait_until(self, slot: int, differs_from: int, polls: int) -> int:
        """Poll, then block, until counter ``slot`` differs from ``differs_from``; its value."""
        address = self._counters.ctypes.data + 8 * slot
        if not self._spin.changed_within(address, differs_from, polls):
            with self._changed:
                while int(self._counters[slot]) == differs_from:
                    self._changed.wait()
        return int(self._counters[slot])

    def _serve(self) -> None:
        _on_helper.flag = True
        cores = frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else frozenset()
        seen = int(self._counters[POSTED])
        moved_for = -1  # the call this helper last moved off its caller's core for
        while True:
            if _compiled is not None:
                seen, why = _compiled[0](self._counters, self._descriptor, seen, self._helper_polls, moved_for)
                if why == ON_CALLERS_CORE:  # move off (once), then the server sees the call again and joins
                    _move_off(int(self._counters[CALLER_CPU]), cores)
                    moved_for = seen + 1
                    continue
                python_call = why == PYTHON_CALL
            else:
                python_call = self._spin.changed_within(self._counters.ctypes.data, seen, self._helper_polls)
                if python_call:  # (after a poll that timed out, `seen` stays: a call posted since is waited for below)
                    seen = int(self._counters[POSTED])
            if not python_call:  # nothing for a while: block until a call is posted
                with self._changed:
                    while int(self._counters[POSTED]) == seen:
                        self._changed.wait()
                _move_off(int(self._counters[CALLER_CPU]), cores)
                continue  # the poll above sees the new number at once
            call = self._call
            if call is None or call.number != seen or not call.join():
                continue
            call.take_ranges()
            if call.leave():
                self._ended(call.number)

    def _ended(self, number: int) -> None:
        with self._changed:
            self._counters[ENDED] = number
            self._changed.notify_all()

    def run(self, work: Callable[[int, int], None], ranges: list[tuple[int, int]], seats: int) -> None:
        """The ranges on the calling thread and up to ``seats`` helpers (inline when another
        call holds the helpers); the first error raised once every range taken has ended."""
        if not self._busy.acquire(blocking=False):
            for start, stop in ranges:
                work(start, stop)
            return
        try:
            self.ensure(seats)
            self._counters[CALLER_CPU] = _current_cpu()
            with self._changed:
                call = _Call(int(self._counters[POSTED]) + 1, work, ranges, seats)
                self._call = call
                self._counters[POSTED] = call.number
                self._changed.notify_all()
            interrupted: BaseException | None = None
            try:
                call.take_ranges()
            except BaseException as exc:  # noqa: BLE001 - an interrupt between ranges; raised below
                with call.lock:
                    call.stopped = True
                interrupted = exc
            if call.close():
                interrupted = self._wait_for_helpers(call) or interrupted
            self._call = None
            error = interrupted or (call.errors[0] if call.errors else None)
            if error is not None:
                raise error
        finally:
            self._busy.release()

    def run_compiled(self, descriptor: np.ndarray, seats: int, caller: Callable | None, arguments: tuple) -> bool:
        """Post a compiled call (its ``descriptor``) for up to ``seats`` helpers and run the
        caller's part; False (nothing run) when another call holds the helpers. Returns, or
        raises, only once no helper is inside the call (they write into the caller's arrays)."""
        if not self._busy.acquire(blocking=False):
            return False
        counters = self._counters
        try:
            self.ensure(seats)
            counters[HOLD] = caller is not None  # it may post more calls: the helpers poll till it ends
            caller = caller or _compiled[1]  # type: ignore[index]
            number = int(counters[POSTED]) + 1
            self._descriptor[: len(descriptor)] = descriptor
            self._descriptor[len(descriptor) :] = 0  # nothing of an earlier call's is read
            counters[NEXT], counters[SEAT], counters[OPEN], counters[COMPILED] = 0, 1, number, number
            counters[CALLER_CPU] = _current_cpu()
            ended, interrupted = False, None
            try:
                with self._changed:
                    counters[POSTED] = number
                    self._changed.notify_all()
                while True:
                    try:
                        if caller(counters, self._descriptor, self._caller_polls, *arguments):
                            ended = True
                            break
                        time.sleep(20e-6)  # a helper without a core for a while: give this one up between polls
                    except Exception:  # the caller itself failed (it did not compile, say): it ran nothing
                        raise
                    except BaseException as exc:  # noqa: BLE001 - an interrupt: raised once the caller has ended
                        interrupted = interrupted or exc
            finally:
                if not ended:  # an error, or an interrupt before the caller ran: helpers may be inside
                    self._close_compiled()
            if interrupted is not None:
                raise interrupted
            return True
        finally:
            counters[HOLD] = 0
            self._busy.release()

    def _close_compiled(self) -> None:
        """Close the posted compiled call and wait, from Python, until no helper is inside it
        (an interrupt meanwhile waits too: the one already on its way is raised)."""
        counters = self._counters
        counters[OPEN] = 0
        while True:
            try:
                while counters[INSIDE] != 0:
                    time.sleep(20e-6)
                return
            except BaseException:  # noqa: BLE001, S112 - a second interrupt: the first is on its way
                continue

    def _wait_for_helpers(self, call: _Call) -> BaseException | None:
        """Until the helpers inside ``call`` have left; an interrupt meanwhile stops the
        handing out and is returned once they have."""
        interrupted = None
        while True:
            try:
                ended = int(self._counters[ENDED])
                while ended != call.number:
                    ended = self._wait_until(ENDED, ended, self._caller_polls)
                return interrupted
            except BaseException as exc:  # noqa: BLE001 - the first interrupt wins
                with call.lock:
                    call.stopped = True
                interrupted = interrupted or exc


@functools.cache
def _getcpu() -> Callable[[], int] | None:
    """The C library's sched_getcpu (glibc, musl), or None where there is none."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    import ctypes

    try:
        function = ctypes.CDLL(None).sched_getcpu
    except (AttributeError, OSError):
        return None
    function.restype, function.argtypes = ctypes.c_int, []
    return function


def _current_cpu() -> int:
    """The core this thread runs on now, or -1 where that cannot be asked."""
    getcpu = _getcpu()
    return -1 if getcpu is None else getcpu()


def _move_off(caller_cpu: int, cores: frozenset[int]) -> None:
    """On a helper whose call was posted from the core it runs on: let it run only on its
    other ``cores`` (its affinity when it started), until a call comes from one of those (then
    it moves again, off that one). A woken thread is placed near the thread that woke it: the
    caller and a helper then shared one core, polling in turn, until the scheduler moved one
    (a 1.3 ms decode layer took ~3 ms, and 2-8 ms before the polls offered the core, for
    several calls after each idle spell; measured). Giving the helper all its cores back at
    once let the next wake put it on the caller's core again (~3 ms again, measured), so it
    keeps the narrower set; the caller's own affinity is never touched."""
    if caller_cpu < 0 or _current_cpu() != caller_cpu or not hasattr(os, "sched_setaffinity"):
        return
    others = cores - {caller_cpu}
    if others:
        try:
            os.sched_setaffinity(0, others)
        except OSError:  # a core set this thread may not use: stay
            pass


def _helpers() -> _Helpers:
    """The process's helpers (started as first needed)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = _Helpers()
        return _pool


def _forget_helpers() -> None:
    """In a forked child the parent's helper threads do not exist: start afresh."""
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_helpers)


def run_ranges(work: Callable[[int, int], None], bounds: Sequence[int] | np.ndarray) -> None:
    """Call ``work(bounds[i], bounds[i + 1])`` once for every i. The calling thread and up to
    ``workers() - 1`` helper threads take the ranges in order, each the next one left as it
    finishes one (so a thread that gets no core, on a machine shared with other work, leaves
    its share to the others); from a helper thread, or while another thread's call holds the
    helpers, every range runs inline, so no helper ever waits for another. Which thread runs a
    range never matters: each range's results are its own. An error stops the handing out;
    the first is raised here, after every range taken has ended (none is left writing into an
    output)."""
    parts = len(bounds) - 1
    ranges = [(int(bounds[i]), int(bounds[i + 1])) for i in range(parts)]
    if parts <= 1 or workers() <= 1 or getattr(_on_helper, "flag", False):
        for start, stop in ranges:
            work(start, stop)
        return
    _helpers().run(work, ranges, min(workers(), parts) - 1)


def run_compiled(descriptor: np.ndarray, parts: int, caller: Callable | None = None, arguments: tuple = ()) -> bool:
    """Run a compiled call, ``parts`` shares described by ``descriptor`` (the registered
    compiled loops' layout), on the calling thread and up to ``workers() - 1`` helpers,
    without the GIL between them. False (nothing run: the caller runs it its own way) when
    no server is registered, on one worker, from a helper, or while another call holds the
    helpers. Blocks until every share has ended; the compiled loops raise nothing.

    ``caller(counters, descriptor, polls, *arguments) -> ended``, compiled, runs the calling
    thread's side instead of the registered one: it may post further calls for the helpers
    (one after another, each once every helper has left the one before) and must return True
    only once every helper has left the last."""
    if _compiled is None or parts <= 1 or workers() <= 1 or getattr(_on_helper, "flag", False):
        return False
    return _helpers().run_compiled(descriptor, min(workers(), parts) - 1, caller, arguments)


def gather_rows(source: np.ndarray, index: np.ndarray) -> np.ndarray:
    """``out[i] = source[index[i]]`` (bit-exact), a row of zeros where ``index[i] < 0``.

    Args:
        source: ``[R, ...]`` any dtype (R may be 0 when every index is negative).
        index: ``[N]`` integer, each in ``[-1, R)`` (checked by the caller).
    Returns:
        ``[N, ...]`` C-contiguous, dtype of ``source``.
    """
    out = buffers.empty((len(index),) + source.shape[1:], source.dtype)
    if len(source) == 0:
        source = np.zeros((1,) + source.shape[1:], source.dtype)

    def work(start: int, stop: int) -> None:
        part, rows = out[start:stop], index[start:stop]
        # mode="clip" writes straight into `out` (mode="raise" gathers into a temporary);
        # a negative index reads row 0 and is zeroed next
        np.take(source, rows, axis=0, out=part, mode="clip")
        empty = rows < 0
        if empty.any():
            part[empty] = 0

    for_row_ranges(work, len(index), source[0].nbytes)
    return out
