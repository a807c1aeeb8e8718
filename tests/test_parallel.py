"""The kernels' helper threads (custom_ops/parallel.py): ranges, errors, nesting, fork."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from moe_onnx.custom_ops import parallel


def test_every_range_runs_once_on_the_caller_and_the_helpers():
    seen: list[tuple[int, int, str]] = []
    lock = threading.Lock()

    def work(start: int, stop: int) -> None:
        with lock:
            seen.append((start, stop, threading.current_thread().name))

    parallel.run_ranges(work, np.array([0, 3, 5, 9]))
    assert sorted((a, b) for a, b, _ in seen) == [(0, 3), (3, 5), (5, 9)]
    caller = threading.current_thread().name
    assert [name for a, _, name in seen if a == 0] == [caller]
    assert all(name.startswith("moe-onnx-kernel") for a, _, name in seen if a != 0)


def test_an_error_is_raised_after_every_range_ended():
    ended: list[int] = []

    def work(start: int, stop: int) -> None:
        if start == 0:
            raise ValueError("the caller's range")
        time.sleep(0.05)
        ended.append(start)

    with pytest.raises(ValueError, match="the caller's range"):
        parallel.run_ranges(work, np.array([0, 1, 2]))
    assert ended == [1]  # the helper's range had ended when the error left


def test_a_helpers_error_reaches_the_caller():
    def work(start: int, stop: int) -> None:
        if start == 1:
            raise KeyError("helper")

    with pytest.raises(KeyError, match="helper"):
        parallel.run_ranges(work, np.array([0, 1, 2]))


def test_ranges_run_from_a_helper_run_inline():
    """A range that itself splits its work runs the inner ranges on its own thread: no helper
    waits for another, so nesting cannot exhaust the helpers."""
    inner_threads: list[str] = []

    def inner(start: int, stop: int) -> None:
        inner_threads.append(threading.current_thread().name)

    def outer(start: int, stop: int) -> None:
        if start == 1:
            parallel.run_ranges(inner, np.array([0, 1, 2, 3]))

    parallel.run_ranges(outer, np.array([0, 1, 2]))
    assert len(inner_threads) == 3 and len(set(inner_threads)) == 1
    assert inner_threads[0].startswith("moe-onnx-kernel")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork is POSIX only")
def test_a_forked_child_gets_helpers_of_its_own():
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
