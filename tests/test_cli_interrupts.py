"""Ctrl-C and SIGTERM end a command with exit 130 / 143 and one line, never an abort, and
``bench`` writes the rows it finished (a few of tests/interrupt_trials.py's trials, at
chosen moments rather than random ones, so each runs in seconds)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from moe_onnx.models import EP_LAYER_SMALL
from tests.interrupt_trials import finish, start


def interrupt_when(process: subprocess.Popen, seen, signum: int) -> tuple[str, str]:
    """Send ``signum`` to the process group once ``seen(stdout line)`` holds; (out, err)."""
    lines = []
    for line in process.stdout:
        lines.append(line)
        if seen(line):
            break
    os.killpg(process.pid, signum)
    out, err = finish(process)
    return "".join(lines) + out, err


def wait_until_caught(pid: int, signum: int, timeout: float = 60.0) -> None:
    """Wait until process ``pid`` catches ``signum`` (Linux: its SigCgt mask), i.e. the command
    script has installed its handlers and is importing the package."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/status") as status:
            caught = next(int(line.split()[1], 16) for line in status if line.startswith("SigCgt:"))
        if caught >> (signum - 1) & 1:
            return
        time.sleep(0.005)
    raise AssertionError(f"process {pid} never caught signal {signum}")


def assert_one_line(err: str, signum: int) -> None:
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines == [lines[0]] and lines[0].endswith(f"interrupted ({signal.Signals(signum).name})"), err


@pytest.mark.parametrize("signum", [signal.SIGINT, pytest.param(signal.SIGTERM, marks=pytest.mark.slow)])
def test_bench_writes_the_rows_it_finished(tmp_path, signum):
    process = start(
        ["bench", "--shape", "tiny", "--repeats", "2",
         "--json", str(tmp_path / "out" / "b.json"), "--markdown", str(tmp_path / "b.md")],
        str(tmp_path),
    )  # fmt: skip
    out, err = interrupt_when(process, lambda line: line.startswith("[3/"), signum)
    assert process.returncode == 128 + signum, err
    assert_one_line(err, signum)
    finished = sum(" floor |" in line for line in out.splitlines())
    rows = json.loads((tmp_path / "out" / "b.json").read_text())
    assert finished >= 3 and len(rows) == finished
    assert (tmp_path / "b.md").read_text().count("\n") == 2 + finished
    assert f"interrupted: {finished} row(s) finished, written" in out


def test_run_on_threads_is_one_line(tmp_path):
    process = start(["run", EP_LAYER_SMALL, "--outputs", str(tmp_path / "out")], str(tmp_path))
    _, err = interrupt_when(process, lambda line: "running 4 rank(s)" in line, signal.SIGINT)
    assert process.returncode in (130, 0), err  # 0: the ranks finished before the signal came
    if process.returncode == 130:
        assert_one_line(err, signal.SIGINT)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_while_the_package_imports(tmp_path, signum):
    """The first second of every command is importing numpy, onnx, the op library."""
    process = start(["lower", EP_LAYER_SMALL, "/nonexistent/never"], str(tmp_path))
    # the script's first act is to catch SIGTERM (Python itself catches SIGINT from its start):
    # wait for it, as a loaded machine may take longer than any fixed delay to get there
    wait_until_caught(process.pid, signal.SIGTERM)
    time.sleep(0.05)
    os.killpg(process.pid, signum)
    _, err = finish(process)
    assert process.returncode == 128 + signum, err
    assert_one_line(err, signum)


HOOK = """
import os, signal, sys, time
import numpy as np
import moe_onnx
from moe_onnx.runtime import pyops
from moe_onnx.builders import single_node_model
from moe_onnx.interrupts import deferred

feeds = {"tokens": np.ones((3, 4), np.float32), "expert_token_num_per_rank": np.array([[1, 2]], np.int32)}
session = moe_onnx.InferenceSession(single_node_model("MoeReRoutingV2", feeds), executor="pyop")

def hook(k_id, feed, attributes):  # called from onnxruntime's C++, as the stock path's is
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.5)  # the signal is taken here, inside the hook
    return pyops.invoke(k_id, feed, attributes)

try:
    with pyops.hook(hook):
        if sys.argv[1] == "bare onnxruntime":  # the executor's own onnxruntime session, called directly
            session._executor.ort_session.run(None, feeds)
        elif sys.argv[1] == "deferred":  # as bench and demo run their cases
            with deferred():
                session.run(None, feeds)
        else:
            session.run(None, feeds)
except KeyboardInterrupt:
    sys.exit(130)
"""


@pytest.mark.parametrize("mode", [pytest.param("bare onnxruntime", marks=pytest.mark.slow), "session", "deferred"])
def test_a_signal_inside_the_pyop_hook(mode):
    """Raised inside a PyOp hook, KeyboardInterrupt crosses C++ and aborts the process (the
    issue's exit 134 of bench). The pyop executor holds it until the call returned, in user
    code as under bench's deferral, so ``session.run`` ends in KeyboardInterrupt, not abort."""
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(HOOK), mode], capture_output=True, text=True)
    if mode == "bare onnxruntime":
        assert result.returncode in (-6, 134) and "terminate called" in result.stderr, result.stderr
    else:
        assert result.returncode == 130, result.stderr
