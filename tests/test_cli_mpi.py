"""Runs beyond one machine, as far as one machine can test them: a hostfile naming this host,
mpiexec options passed through, ranks started by the user's own mpiexec joining one job;
and the launcher's one line in place of Open MPI's MPI_ABORT notice."""

from __future__ import annotations

import io
import os
import socket
import subprocess
import sys

import numpy as np
import onnx
import pytest

from moe_onnx.commands.launch import MpiJob, NoticeFilter, error_lines, launcher_options, mpiexec
from moe_onnx.models.ep_layer import LayerConfig, build_rank_model, dense_reference, example_inputs, make_weights
from tests.support import all_to_all_model

TOLERANCE = dict(rtol=1e-4, atol=1e-5)


def layer(tmp_path, ranks: int = 2):
    config = LayerConfig(ranks=ranks)
    weights = make_weights(config, seed=3)
    for r in range(ranks):
        onnx.save(build_rank_model(config, weights, r), tmp_path / f"rank{r}.onnx")
    xs = example_inputs(config, seed=3)
    for r, x in enumerate(xs):
        np.savez(tmp_path / f"in{r}.npz", x=x)
    return config, weights, xs


def moe_onnx_run(*args, launcher: list[str] | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    command = [*(launcher or []), sys.executable, "-m", "moe_onnx_command", "run", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)


def check_outputs(tmp_path, config, weights, xs) -> None:
    for r, x in enumerate(xs):
        y = np.load(tmp_path / "out" / f"rank{r}.npz")["y"]
        np.testing.assert_allclose(y, dense_reference(config, weights, x), **TOLERANCE)


def test_launcher_options():
    assert launcher_options(None, None) == (["--oversubscribe"], True)
    assert launcher_options(None, "--bind-to none -x A=1") == (
        ["--oversubscribe", "--bind-to", "none", "-x", "A=1"],
        True,
    )
    options, local = launcher_options(None, "--host a,b")
    assert options == ["--host", "a,b"] and not local  # mpiexec places them; the start watch is off


def test_hostfile_of_other_hosts_is_not_local(tmp_path):
    (tmp_path / "hosts").write_text("# two nodes\nnode1 slots=4\nnode2 slots=4\n")
    assert launcher_options(str(tmp_path / "hosts"), None) == (["--hostfile", str(tmp_path / "hosts")], False)
    (tmp_path / "here").write_text(f"{socket.gethostname()} slots=2\nlocalhost\n")
    assert launcher_options(str(tmp_path / "here"), None)[1]


def test_open_mpi_notices_that_a_rank_aborted_are_held_back():
    banner = "-" * 74 + "\n"
    text = (
        "a line of a rank\n"
        + banner
        + "MPI_ABORT was invoked on rank 0 in communicator MPI_COMM_WORLD\n  Errorcode: 2\n"
        + banner
        + banner
        + "There are not enough slots available in the system\n"
        + banner
        + "\0"
    )
    out = io.StringIO()
    notices = NoticeFilter(io.StringIO(text), out)
    notices.finish()
    assert (
        out.getvalue()
        == "a line of a rank\n" + banner + "There are not enough slots available in the system\n" + banner
    )
    notices.release()  # when no rank said why, Open MPI's notice is all there is
    assert "MPI_ABORT was invoked" in out.getvalue()


def test_error_lines_name_each_cause_once():
    failures = {
        0: ("MoeOpError", "AllToAll node 'a': rank 1: bad counts (reported by rank 1)", False),
        1: ("MoeOpError", "AllToAll node 'a': rank 1: bad counts", False),
        2: ("PeerStopped", "rank 2 stopped: rank 1 failed: ...", True),
    }
    assert error_lines(failures) == [
        "ranks 0, 1: error: MoeOpError: AllToAll node 'a': rank 1: bad counts (rank 2 stopped because of it)"
    ]
    timeouts = {
        r: ("RuntimeError", f"rank {r} stopped: rank 2 did not reach AllToAll within 5 s", False) for r in (0, 1)
    }
    assert error_lines(timeouts) == ["ranks 0, 1: error: RuntimeError: rank 2 did not reach AllToAll within 5 s"]


@pytest.mark.parametrize(
    ("cause", "refused", "mpiexec_code", "code"),
    [("FeedError", True, 1, 2), ("FeedError", True, 2, 2), ("RuntimeError", False, 2, 1)],
)
def test_the_exit_code_is_the_causes_not_the_first_abort(cause, refused, mpiexec_code, code):
    """A refusal on one rank is exit 2 however the job ends: its peers, stopped by it, abort with
    code 1, and mpiexec gives the code of whichever MPI_Abort came first (1 in 2 of 6 runs of
    a refused feed on 4 ranks); the launcher reads the cause from the ranks' marks."""
    script = "\n".join(
        [
            "import json, os, sys",
            "marks = os.path.join(os.environ['MOE_ONNX_MPI_JOB'], 'marks')",
            f"record = [{cause!r}, 'input x is wrong', False, {refused}]",
            "json.dump(record, open(os.path.join(marks, 'rank1.failed'), 'w'))",
            "json.dump(['PeerStopped', 'rank 0 stopped: rank 1 failed', True, False], "
            "open(os.path.join(marks, 'rank0.failed'), 'w'))",
            f"sys.exit({mpiexec_code})",
        ]
    )
    lines = []
    with MpiJob(2, 10, echo=lambda line, **_: lines.append(line)) as job:
        assert job.run([sys.executable, "-c", script]) == code
    assert lines == [f"rank 1: error: {cause}: input x is wrong (rank 0 stopped because of it)"]


@pytest.mark.mpi
def test_a_refusal_is_one_line_not_open_mpis_notice(tmp_path):
    onnx.save(all_to_all_model(), tmp_path / "a2a.onnx")
    result = moe_onnx_run(str(tmp_path / "a2a.onnx"), "--ranks", "2", "--backend", "mpi")
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "MoeOpError: AllToAll node 'a2a': rank 0: send_counts must be [N] = [2]" in lines[0]
    assert "MPI_ABORT" not in result.stderr and "prterun" not in result.stderr


@pytest.mark.mpi
@pytest.mark.slow  # 3-14 s, mostly mpiexec's start
def test_hostfile_naming_this_machine(tmp_path):
    config, weights, xs = layer(tmp_path, ranks=2)
    (tmp_path / "hosts").write_text(f"{socket.gethostname()} slots=2\n")
    result = moe_onnx_run(
        str(tmp_path), "--backend", "mpi", "--hostfile", str(tmp_path / "hosts"),
        "--mpiexec-args=--bind-to none", "--inputs", str(tmp_path / "in{r}.npz"), "--outputs", str(tmp_path / "out"),
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "rank 1: done" in result.stdout
    check_outputs(tmp_path, config, weights, xs)


@pytest.mark.mpi
@pytest.mark.slow
def test_ranks_started_by_the_users_mpiexec_join_one_job(tmp_path):
    config, weights, xs = layer(tmp_path, ranks=2)
    result = moe_onnx_run(
        str(tmp_path), "--backend", "mpi", "--inputs", str(tmp_path / "in{r}.npz"), "--outputs", str(tmp_path / "out"),
        launcher=[mpiexec(), "--oversubscribe", "-n", "2"],
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "under mpiexec" not in result.stdout  # joined, not launched again
    assert sorted(line.split(":")[0] for line in result.stdout.splitlines() if "done" in line) == ["rank 0", "rank 1"]
    check_outputs(tmp_path, config, weights, xs)


@pytest.mark.mpi
@pytest.mark.slow
def test_a_joined_job_refuses_once_when_its_size_disagrees(tmp_path):
    layer(tmp_path, ranks=2)
    result = moe_onnx_run(str(tmp_path), "--backend", "mpi", launcher=[mpiexec(), "--oversubscribe", "-n", "3"])
    assert result.returncode == 2
    ours = [line for line in result.stderr.splitlines() if "error:" in line]
    assert ours == [
        f"ranks 0, 1, 2: error: UserError: MODEL {tmp_path} has 2 rank file(s), but this MPI job has 3 rank(s)"
    ]


def running_md_block(after: str) -> str:
    """The bash block of docs/running.md that follows the line starting with ``after``."""
    text = open(os.path.join(os.path.dirname(__file__), "..", "docs", "running.md")).read()
    start = text.index("\n" + after)
    return text[
        text.index("```bash\n", start) + len("```bash\n") : text.index("```", text.index("```bash\n", start) + 7)
    ]


@pytest.mark.mpi
@pytest.mark.slow  # ~20 s: three mpiexec starts
def test_the_localhost_and_root_blocks_of_running_md_run_as_written(tmp_path):
    """As a user types them, in a shell: a hostfile naming localhost, then the user's own
    mpiexec as root (--allow-run-as-root, or the two variables): no OMPI_ALLOW_* set before."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMPI_ALLOW")}
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), os.path.dirname(mpiexec()), env.get("PATH", "")])
    for after in ("A hostfile naming this machine", "Open MPI refuses to start as root"):
        for line in running_md_block(after).splitlines():
            line = line.replace("python -m", f"{sys.executable} -m")
            result = subprocess.run(
                line, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
            )
            assert result.returncode == 0, f"{line}\n{result.stdout}\n{result.stderr}"
            if "moe-onnx run" in line:
                assert "rank 0: done" in result.stdout and "rank 1: done" in result.stdout, result.stdout
