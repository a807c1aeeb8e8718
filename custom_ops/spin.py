"""Waiting a few microseconds without giving up the core: the kernel helpers' hand-off.

A thread blocked on a lock or a condition gives its core back; on a virtual machine an idle
core is halted, and waking it again took 50-80 us here (measured: a helper started 55 us after
the call, the caller resumed 77 us after the helper ended), while a decode call's share of
work is 100-300 us. So, like OpenMP's and onnxruntime's thread pools, the helpers poll for a
short while before they block. The polling loop is compiled (numba, no GIL held): a load with
acquire order of an int64 that another thread changes, and x86's ``pause`` between loads.
The same atomics let a compiled loop hand out shares of a call to the threads that poll
(:func:`.fused_loops.serve_compiled_calls`): no GIL is taken between them. Imported on first
use (numba is slow to import).

Every :data:`YIELD_EVERY` polls a polling thread offers its core to another thread waiting
for it (``sched_yield``, ~0.2 us when there is none). A helper woken after an idle spell was
often put on the caller's core (the scheduler places a woken thread near its waker): the
two then polled in turn, each for whole time slices, and a 1.3 ms decode layer took 2-8 ms
for several calls after each 50 ms pause until the scheduler moved one of them (measured;
with these offers ~3 ms; with the helper moved off the caller's core as well,
:func:`.parallel._move_off`, 1.7-2.2 ms).
"""

from __future__ import annotations

import functools
import os
import platform
import time
from typing import Any

import numpy as np
from llvmlite import ir as llvm_ir
from numba import njit, types
from numba.extending import intrinsic, overload

_X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686", "x86")


def _int64_at(builder, address):
    return builder.inttoptr(address, llvm_ir.IntType(64).as_pointer())


def _fetch_add(typingctx, address, value):
    """Add ``value`` to the int64 at ``address`` atomically (sequentially consistent); its old value."""

    def codegen(context, builder, signature, args):
        return builder.atomic_rmw("add", _int64_at(builder, args[0]), args[1], "seq_cst")

    return types.int64(types.intp, types.int64), codegen


fetch_add: Any = intrinsic(_fetch_add)


def _exchange(typingctx, address, value):
    """Store ``value`` at ``address`` atomically (sequentially consistent: a full fence); the old value."""

    def codegen(context, builder, signature, args):
        return builder.atomic_rmw("xchg", _int64_at(builder, args[0]), args[1], "seq_cst")

    return types.int64(types.intp, types.int64), codegen


exchange: Any = intrinsic(_exchange)


def _load_acquire(typingctx, address):
    """The int64 at ``address``, loaded with acquire order."""

    def codegen(context, builder, signature, args):
        return builder.load_atomic(_int64_at(builder, args[0]), "acquire", 8)

    return types.int64(types.intp), codegen


load_acquire: Any = intrinsic(_load_acquire)


def _pause(typingctx):
    """x86's ``pause`` (a spin-wait hint: the core slows the loop and spares its sibling); nothing elsewhere."""

    def codegen(context, builder, signature, args):
        if _X86:
            pause = builder.module.declare_intrinsic(
                "llvm.x86.sse2.pause", fnty=llvm_ir.FunctionType(llvm_ir.VoidType(), [])
            )
            builder.call(pause, [])
        return context.get_dummy_value()

    return types.void(), codegen


pause: Any = intrinsic(_pause)


def _c_library_has(name: str) -> bool:
    """Whether the process's C library exports ``name`` (macOS has no sched_getcpu)."""
    if os.name == "nt":
        return False
    import ctypes

    try:
        return hasattr(ctypes.CDLL(None), name)
    except OSError:
        return False


#: the C library's usleep (POSIX), or None where there is none (the waits below only poll)
_usleep: Any = None if os.name == "nt" else types.ExternalFunction("usleep", types.int32(types.uint32))


#: the C library's sched_yield (POSIX), or None where there is none
_sched_yield: Any = types.ExternalFunction("sched_yield", types.int32()) if _c_library_has("sched_yield") else None
#: the C library's sched_getcpu (glibc, musl), or None where there is none
_sched_getcpu: Any = types.ExternalFunction("sched_getcpu", types.int32()) if _c_library_has("sched_getcpu") else None


def current_cpu():
    """The core this thread runs on now (sched_getcpu), or -1 where that cannot be asked."""


@overload(current_cpu)
def _current_cpu_impl():
    if _sched_getcpu is None:
        return lambda: np.int64(-1)
    return lambda: np.int64(_sched_getcpu())


#: polls between two offers of the core (~3 us of polling here; the offer costs ~0.2 us)
YIELD_EVERY = 256


def offer_core():
    """Let another thread waiting for this core run now (sched_yield; nothing elsewhere)."""


@overload(offer_core)
def _offer_core_impl():
    if _sched_yield is None:
        return lambda: None

    def offer():
        _sched_yield()

    return offer


@njit(inline="always")
def poll_pause(poll):
    """Between two polls: x86's ``pause``, and every :data:`YIELD_EVERY` polls an offer of the core."""
    pause()
    if poll % YIELD_EVERY == YIELD_EVERY - 1:
        offer_core()


def _sleep_micro(microseconds):
    """Give the core up for about ``microseconds`` (usleep; on Windows a ``pause`` instead)."""


@overload(_sleep_micro)
def _sleep_micro_impl(microseconds):
    if _usleep is None:
        return lambda microseconds: pause()
    return lambda microseconds: _usleep(np.uint32(microseconds))


@njit(nogil=True, cache=True)
def wait_until_zero(address: int, polls: int) -> None:
    """Until the int64 at ``address`` is 0: ``polls`` polls, then a poll every ~20 us with the
    core given up between them (a thread that needs the core to finish, e.g. a helper another
    process's spinning threads pushed off, gets it; the Python caller sleeps the same way)."""
    for poll in range(polls):
        if load_acquire(address) == 0:
            return
        poll_pause(poll)
    while load_acquire(address) != 0:
        _sleep_micro(20)


@njit(nogil=True, cache=True)
def changed_within(address: int, value: int, polls: int) -> bool:
    """Whether the int64 at ``address`` differs from ``value`` within ``polls`` polls."""
    for poll in range(polls):
        if load_acquire(address) != value:
            return True
        poll_pause(poll)
    return load_acquire(address) != value


@functools.cache
def polls_per_second() -> float:
    """How many polls of :func:`changed_within` take a second on this machine (measured once, ~2 ms)."""
    import numpy as np

    still = np.zeros(1, np.int64)
    changed_within(still.ctypes.data, 0, 10)  # compiled (or loaded from numba's cache)
    polls = 1 << 12
    while True:
        start = time.perf_counter()
        changed_within(still.ctypes.data, 0, polls)
        seconds = time.perf_counter() - start
        if seconds > 1e-3 or polls >= 1 << 26:
            return polls / max(seconds, 1e-9)
        polls *= 4
