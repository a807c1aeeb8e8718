"""Ranks that fail in the ways ranks fail: mismatched collectives, wrapped counts, stopped or
killed MPI processes. Every fault stops every rank with a message naming the rank and the
cause, and an MPI job leaves no folder behind."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import onnx
import pytest

import moe_onnx
from moe_onnx.commands.launch import JOB_FOLDER
from moe_onnx.custom_ops import OPS
from moe_onnx.models.ep_layer import LayerConfig, build_rank_model, example_inputs, make_weights
from moe_onnx.ranks import END_OF_RUN, CollectiveMismatch, RankFailure, ThreadWorld, run_threads
from tests.support import all_to_all_model

# --- a rank whose model has no matching collective -------------------------------------


def test_rank_without_all_to_all_is_named_on_every_rank_threads():
    models = [all_to_all_model(), all_to_all_model(with_all_to_all=False), all_to_all_model()]
    feeds = [{"data": np.ones((3, 3), np.float32), "send_counts": np.array([1, 1, 1])}] * 3
    with pytest.raises(RankFailure) as failure:
        run_threads(models, feeds, timeout=30)
    errors = failure.value.errors
    assert sorted(errors) == [0, 1, 2]
    for error in errors.values():
        assert isinstance(error, CollectiveMismatch)
        assert f"rank 1 reached {END_OF_RUN}" in str(error) and "ranks 0, 2 reached AllToAll" in str(error)


def test_models_without_collectives_still_run_threads():
    models = [all_to_all_model(with_all_to_all=False)] * 2
    feeds = [{"data": np.ones((2, 3), np.float32), "send_counts": np.array([1, 1])}] * 2
    results = run_threads(models, feeds, timeout=30)
    assert [r[0].shape for r in results] == [(2, 3), (2, 3)]


def test_thread_deadline_names_the_rank_that_never_arrived():
    world = ThreadWorld(3, timeout=0.3)
    errors: dict[int, BaseException] = {}

    def rank(r: int) -> None:
        try:
            world.communicator(r).allgather(r, "AllToAll")
        except RuntimeError as exc:
            errors[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 2)]  # rank 1 never comes
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(errors) == [0, 2]
    assert all("rank 1 did not reach AllToAll within 0.3 s" in str(e) for e in errors.values())


# --- AllToAll counts and data ----------------------------------------------------------


def test_wrapped_send_counts_are_a_moe_op_error_on_every_rank():
    """4 x 2**62 sums to 0 in int64: with 0 rows it used to pass the sum check."""
    model = all_to_all_model()
    good = {"data": np.zeros((4, 3), np.float32), "send_counts": np.array([1, 1, 1, 1])}
    wrapped = {"data": np.zeros((0, 3), np.float32), "send_counts": np.full(4, 2**62, np.int64)}
    assert int(wrapped["send_counts"].sum()) == 0  # the wrap this test is about
    with pytest.raises(RankFailure) as failure:
        run_threads([model] * 4, [good, wrapped, good, good], timeout=30)
    for r in range(4):
        error = failure.value.errors[r]
        assert isinstance(error, moe_onnx.MoeOpError) and error.node_name == "a2a"
        assert f"rank 1: sum(send_counts) = {4 * 2**62} must equal data rows S = 0" in str(error)
        assert str([2**62] * 4) in str(error)


@pytest.mark.parametrize("op", [OPS["AllToAll"], moe_onnx.custom_ops.ALL_OPS[("com.microsoft", "AllToAll")]])
def test_scalar_all_to_all_data_is_a_moe_op_error(op):
    communicator = ThreadWorld(1, timeout=5).communicator(0)
    inputs = [np.float32(1.0)] + ([np.array([1], np.int64)] if op.domain == moe_onnx.DOMAIN else [])
    attrs = {} if op.domain == moe_onnx.DOMAIN else {"group_size": 1}
    with pytest.raises(moe_onnx.MoeOpError, match="rank >= 1"):
        op(*inputs, context={"communicator": communicator}, **attrs)


# --- MPI: stopped, killed, mismatched --------------------------------------------------


def small_layer_files(folder, ranks: int) -> str:
    config = LayerConfig(ranks=ranks)
    weights = make_weights(config, seed=0)
    for r in range(ranks):
        onnx.save(build_rank_model(config, weights, r), folder / f"rank{r}.onnx")
    return str(folder)


def launch(model: str, ranks: int, timeout: float) -> subprocess.Popen:
    command = [sys.executable, "-m", "moe_onnx.commands.cli", "run", model, "--ranks", str(ranks), "--backend", "mpi"]
    command += ["--timeout", str(timeout)]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _environ(pid: int) -> dict[bytes, bytes]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        return dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)


def _descends_from(pid: int, ancestor: int) -> bool:
    while pid > 1:
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except OSError:
            return False
        if pid == ancestor:
            return True
    return False


def rank_process(launcher: subprocess.Popen, rank: int, within: float = 60) -> tuple[int, str]:
    """(pid, job folder) of ``rank``'s process of the job ``launcher`` started."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or not _descends_from(int(entry), launcher.pid):
                continue
            try:
                environ = _environ(int(entry))
            except OSError:
                continue
            if environ.get(b"OMPI_COMM_WORLD_RANK") == str(rank).encode() and JOB_FOLDER.encode() in environ:
                return int(entry), environ[JOB_FOLDER.encode()].decode()
        time.sleep(0.01)
    raise AssertionError(f"rank {rank}'s process did not appear")


def wait_for_mark(job_folder: str, rank: int, state: str, within: float = 60) -> None:
    mark = os.path.join(job_folder, "marks", f"rank{rank}.{state}")
    deadline = time.monotonic() + within
    while not os.path.exists(mark):
        assert time.monotonic() < deadline, f"rank {rank} never left its {state} mark"
        time.sleep(0.002)


def finish(launcher: subprocess.Popen, pid: int, job_folder: str) -> str:
    """The launcher's output; the stopped rank must be gone and the job's folder removed."""
    try:
        output, _ = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
        try:
            if _environ(pid).get(JOB_FOLDER.encode()) == job_folder.encode():
                os.kill(pid, signal.SIGKILL)
                raise AssertionError(f"rank process {pid} outlived its job")
        except OSError:
            pass  # gone, as it should be
    assert not os.path.exists(job_folder), "the job's folder (Open MPI's session files) was left"
    return output


@pytest.mark.mpi
def test_mpi_rank_stopped_before_it_starts(tmp_path):
    """SIGSTOP while rank 1 imports: its peers wait inside MPI_Init, where only the launcher's
    watchdog can stop the job."""
    launcher = launch(small_layer_files(tmp_path, 2), 2, timeout=1)
    pid, job_folder = rank_process(launcher, 1)
    os.kill(pid, signal.SIGSTOP)
    output = finish(launcher, pid, job_folder)
    assert launcher.returncode == 124, output
    # where the signal lands decides which of the two is seen: before or inside MPI startup
    assert (
        "error: rank 1 (stopped, e.g. by SIGSTOP) never started; the other ranks waited 1 s" in output
        or "did not get through MPI startup" in output
    ), output


@pytest.mark.mpi
@pytest.mark.slow
def test_mpi_rank_stopped_mid_run(tmp_path):
    """SIGSTOP once rank 1 is past the startup barrier: its peer's wait names it."""
    launcher = launch(small_layer_files(tmp_path, 2), 2, timeout=2)
    pid, job_folder = rank_process(launcher, 1)
    wait_for_mark(job_folder, 1, "ready")
    os.kill(pid, signal.SIGSTOP)
    output = finish(launcher, pid, job_folder)
    assert launcher.returncode not in (0, None), output
    # said once, by rank 0; rank 1 stops while it prepares (its session) or before its AllToAll
    reached = r"(preparation \(collective 2\)|AllToAll \(collective 3\))"
    assert re.search(rf"rank 0: error: RuntimeError: rank 1 did not reach {reached} within 2 s", output), output


@pytest.mark.mpi
def test_mpi_rank_killed_mid_run(tmp_path):
    """SIGKILL once rank 1 is past the startup barrier: Open MPI ends the job; the launcher
    names the rank whose process ended first."""
    launcher = launch(small_layer_files(tmp_path, 2), 2, timeout=30)
    pid, job_folder = rank_process(launcher, 1)
    wait_for_mark(job_folder, 1, "ready")
    os.kill(pid, signal.SIGKILL)
    output = finish(launcher, pid, job_folder)
    assert launcher.returncode == 1, output  # a documented code, never mpiexec's own (issue 32: 213)
    assert "error: rank 1 ended first, without a report (killed or crashed); mpiexec exited with code" in output


@pytest.mark.mpi
def test_mpi_rank_without_all_to_all(tmp_path):
    onnx.save(all_to_all_model(), tmp_path / "rank0.onnx")
    onnx.save(all_to_all_model(with_all_to_all=False), tmp_path / "rank1.onnx")
    for r in range(2):
        np.savez(tmp_path / f"in{r}.npz", data=np.ones((2, 3), np.float32), send_counts=np.array([1, 1]))
    command = [sys.executable, "-m", "moe_onnx.commands.cli", "run", str(tmp_path), "--ranks", "2", "--backend", "mpi"]
    command += ["--inputs", str(tmp_path / "in{r}.npz"), "--timeout", "30"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "TypeError" not in result.stderr
    # both ranks see the mismatch; said once (for the ranks that reported it before the job ended)
    line = result.stderr.strip()
    assert line.startswith(("ranks 0, 1: error: CollectiveMismatch: ", "rank 0: error: CollectiveMismatch: ",
                            "rank 1: error: CollectiveMismatch: ")), result.stderr  # fmt: skip
    assert "rank 0 reached AllToAll; rank 1 reached end of run" in line and "\n" not in line


def test_end_of_run_changes_nothing_for_matching_models():
    """The end-of-run collective changes nothing for models whose collectives line up."""
    config = LayerConfig(ranks=2)
    weights = make_weights(config, seed=1)
    models = [build_rank_model(config, weights, r) for r in range(2)]
    xs = example_inputs(config, seed=1)
    first = run_threads(models, [{"x": x} for x in xs])
    second = run_threads(models, [{"x": x} for x in xs])
    for (a,), (b,) in zip(first, second):
        assert np.array_equal(a, b)
