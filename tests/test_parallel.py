"""The kernels' helper threads (custom_ops/parallel.py): ranges, errors, nesting, fork."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from moe_onnx.custom_ops import parallel


@pytest.fixture
def two_cores(monkeypatch):
    """workers() == 2 whatever the machine (a one-core CI runner would run every range inline)."""
    monkeypatch.setattr(parallel, "_cpu_count", lambda: 2)
    monkeypatch.setattr(parallel, "_MAX_WORKERS", 4)


def test_every_range_runs_once_on_the_caller_or_a_helper(two_cores):
    seen: list[tuple[int, int, str]] = []
    lock = threading.Lock()

    def work(start: int, stop: int) -> None:
        time.sleep(0.01)  # long enough for the helper to take some
        with lock:
            seen.append((start, stop, threading.current_thread().name))

    parallel.run_ranges(work, np.array([0, 3, 5, 9, 10, 12]))
    assert sorted((a, b) for a, b, _ in seen) == [(0, 3), (3, 5), (5, 9), (9, 10), (10, 12)]
    names = {name for _, _, name in seen}
    assert threading.current_thread().name in names
    assert all(name == threading.current_thread().name or name.startswith("moe-onnx-kernel") for name in names)


def test_a_thread_held_up_leaves_the_other_ranges_to_the_others(two_cores):
    """The ranges are taken one at a time: while one thread is held in a range (as a thread
    that gets no core on a busy machine), the other takes every range left."""
    ran_by: dict[int, str] = {}

    def work(start: int, stop: int) -> None:
        if start == 0:
            time.sleep(0.3)
        ran_by[start] = threading.current_thread().name

    parallel.run_ranges(work, np.arange(11))
    assert sorted(ran_by) == list(range(10))
    held = ran_by[0]
    assert all(name != held for start, name in ran_by.items() if start != 0)


def test_an_error_is_raised_after_every_range_taken_ended(two_cores):
    started: set[int] = set()
    ended: set[int] = set()

    def work(start: int, stop: int) -> None:
        started.add(start)
        if start == 0:
            raise ValueError("the first range")
        time.sleep(0.05)
        ended.add(start)

    with pytest.raises(ValueError, match="the first range"):
        parallel.run_ranges(work, np.arange(6))
    assert started - {0} == ended  # none still running when the error left
    assert len(started) < 5  # and the handing out stopped


def test_an_error_in_any_range_reaches_the_caller(two_cores):
    def work(start: int, stop: int) -> None:
        time.sleep(0.01)
        if start == 1:
            raise KeyError("the second range")

    with pytest.raises(KeyError, match="the second range"):
        parallel.run_ranges(work, np.array([0, 1, 2]))


def test_ranges_run_from_a_helper_run_inline(two_cores):
    """A range that itself splits its work runs the inner ranges on its own thread when it is
    a helper: no helper waits for another, so nesting cannot exhaust the helpers."""
    inner_threads: dict[str, list[str]] = {}

    def outer(start: int, stop: int) -> None:
        time.sleep(0.05)  # both threads take outer ranges
        me = threading.current_thread().name
        if me.startswith("moe-onnx-kernel"):
            ran: list[str] = []
            parallel.run_ranges(lambda a, b: ran.append(threading.current_thread().name), np.array([0, 1, 2, 3]))
            inner_threads[me] = ran

    parallel.run_ranges(outer, np.arange(5))
    assert inner_threads  # a helper took an outer range
    for helper, ran in inner_threads.items():
        assert ran == [helper] * 3


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork is POSIX only")
def test_a_forked_child_gets_helpers_of_its_own(two_cores):
    parallel.run_ranges(lambda a, b: None, np.array([0, 1, 2]))  # the parent's helpers exist
    pid = os.fork()
    if pid == 0:  # the child: a hang here would be the parent's dead helpers
        try:
            done: list[int] = []
            parallel.run_ranges(lambda a, b: done.append(a), np.array([0, 1, 2]))
            os._exit(0 if sorted(done) == [0, 1] else 3)
        except BaseException:
            os._exit(4)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        finished, status = os.waitpid(pid, os.WNOHANG)
        if finished:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.01)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    pytest.fail("the forked child hung on the parent's helper threads")


def test_a_compiled_call_is_refused_where_it_cannot_run_on_the_helpers(two_cores, monkeypatch):
    """run_compiled returns False (the caller runs the work its own way) with one share, on one
    worker, from a helper, and while another call holds the helpers; nothing is posted then."""
    from moe_onnx.custom_ops import fused_loops

    fused_loops.serve_compiled_lane_dots()
    helpers = parallel._helpers()
    posted = int(helpers._counters[parallel.POSTED])
    descriptor = np.zeros(8, np.int64)
    assert not parallel.run_compiled(descriptor, 1)
    seen: list[bool] = []

    def from_a_helper(start: int, stop: int) -> None:
        if threading.current_thread().name.startswith("moe-onnx-kernel"):
            seen.append(parallel.run_compiled(descriptor, 4))
        time.sleep(0.05)

    parallel.run_ranges(from_a_helper, np.arange(4))
    assert seen == [False] * len(seen) and seen  # a helper took a range, and was refused there
    posted = int(helpers._counters[parallel.POSTED])
    with helpers._busy:  # another thread's call
        assert not parallel.run_compiled(descriptor, 4)
    monkeypatch.setattr(parallel, "_cpu_count", lambda: 1)
    assert not parallel.run_compiled(descriptor, 4)
    assert int(helpers._counters[parallel.POSTED]) == posted


def test_the_helpers_poll_time_is_configurable(monkeypatch):
    """$MOE_ONNX_HELPER_POLL_US: the helper's poll in microseconds (0: the caller blocks at once
    too); a bad value is refused by name."""
    monkeypatch.delenv(parallel.POLL_VARIABLE, raising=False)
    assert parallel._poll_seconds() == (parallel._HELPER_POLL_SECONDS, parallel._CALLER_POLL_SECONDS)
    monkeypatch.setenv(parallel.POLL_VARIABLE, "0")
    assert parallel._poll_seconds() == (0.0, 0.0)
    monkeypatch.setenv(parallel.POLL_VARIABLE, "5000")
    assert parallel._poll_seconds() == (5e-3, 5e-3)
    for bad in ("fast", "-1", "nan", "inf"):
        monkeypatch.setenv(parallel.POLL_VARIABLE, bad)
        with pytest.raises(ValueError, match="MOE_ONNX_HELPER_POLL_US"):
            parallel._poll_seconds()


@pytest.mark.parametrize("compiled_server", [False, True])
def test_helpers_that_block_at_once_still_take_ranges(two_cores, monkeypatch, compiled_server):
    """With the polls at 0 every hand-off goes through the blocking wait (with or without the
    compiled server registered): while the caller is held in one range, the helper takes all
    the others, call after call."""
    if compiled_server:
        from moe_onnx.custom_ops import fused_loops

        fused_loops.serve_compiled_lane_dots()
    else:
        monkeypatch.setattr(parallel, "_compiled", None)
    helpers = parallel._helpers()
    monkeypatch.setattr(helpers, "_helper_polls", 0)
    monkeypatch.setattr(helpers, "_caller_polls", 0)
    for _ in range(5):
        ran_by: dict[int, str] = {}

        def work(start: int, stop: int, ran_by=ran_by) -> None:
            if start == 0:
                time.sleep(0.2)
            ran_by[start] = threading.current_thread().name

        parallel.run_ranges(work, np.arange(9))
        assert sorted(ran_by) == list(range(8))
        held = ran_by[0]
        assert all(name != held for start, name in ran_by.items() if start != 0), ran_by


def test_an_interrupt_in_a_compiled_call_is_raised_once_the_helpers_have_left(two_cores, monkeypatch):
    """The helpers of a compiled call write into the caller's arrays: a Ctrl-C while the caller
    waits for them is raised only once they have left (here: the third poll says so)."""
    from moe_onnx.custom_ops import fused_loops

    fused_loops.serve_compiled_lane_dots()
    polls: list[int] = []

    def caller(counters, descriptor, poll_count):
        polls.append(poll_count)
        if len(polls) == 1:
            raise KeyboardInterrupt  # as a signal arriving while the caller waits
        if len(polls) < 3:
            return False
        fused_loops.run_compiled_call(counters, descriptor, poll_count)  # close the (empty) call
        return True

    server = parallel._compiled[0]  # type: ignore[index]
    monkeypatch.setattr(parallel, "_compiled", (server, caller))
    with pytest.raises(KeyboardInterrupt):
        parallel.run_compiled(np.zeros(parallel.DESCRIPTOR_SLOTS, np.int64), 4)  # no shares: its count is 0
    assert len(polls) == 3
    helpers = parallel._helpers()
    assert not helpers._busy.locked()
    for _ in range(50):  # the helper that joined the empty call leaves it at once
        if helpers._counters[parallel.INSIDE] == 0:
            break
        time.sleep(0.01)
    assert helpers._counters[parallel.INSIDE] == 0


def test_a_compiled_caller_that_fails_is_raised_once_the_helpers_have_left(two_cores):
    """A caller that raises an error (numba refusing to compile it, say) ran nothing: the error
    is raised at once, not retried forever as an interrupt would be, after the call is closed
    and no helper is inside it; the helpers are free and no longer held polling."""
    from moe_onnx.custom_ops import fused_loops

    fused_loops.serve_compiled_lane_dots()
    calls: list[int] = []

    def failing(counters, descriptor, polls, *arguments):
        calls.append(len(arguments))
        raise ValueError("cannot compile")

    outcome: list[BaseException] = []

    def run() -> None:
        try:
            parallel.run_compiled(np.zeros(parallel.DESCRIPTOR_SLOTS, np.int64), 4, failing, (1, 2))
        except ValueError as error:
            outcome.append(error)

    caller_thread = threading.Thread(target=run, daemon=True)  # (a regression would spin forever)
    caller_thread.start()
    caller_thread.join(10)
    assert not caller_thread.is_alive(), "run_compiled retried a failing caller"
    assert calls == [2] and len(outcome) == 1
    helpers = parallel._helpers()
    assert not helpers._busy.locked()
    assert helpers._counters[parallel.OPEN] == 0 and helpers._counters[parallel.INSIDE] == 0
    assert helpers._counters[parallel.HOLD] == 0
