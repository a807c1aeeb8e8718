"""``moe-onnx run``: one model on N ranks, with the threads or the MPI backend.

MODEL is a file every rank runs, a directory of ``rank{r}.onnx`` files, or a path with
``{r}`` in it. Inputs come from ``rank{r}.npz`` files (``--inputs`` with ``{r}``) or a seeded
example batch; each rank's outputs go to ``DIR/rank{r}.npz`` keyed by graph output name.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import time
from typing import Any

import numpy as np

from .ranks import MpiCommunicator, example_feeds, run_threads
from .session import InferenceSession, load_model


def rank_model_path(model: str, rank: int) -> str:
    if os.path.isdir(model):
        return os.path.join(model, f"rank{rank}.onnx")
    return model.replace("{r}", str(rank))


def rank_feeds(model_path: str, inputs: str | None, rank: int, seed: int) -> dict[str, np.ndarray]:
    if inputs is None:
        return example_feeds(model_path, rank, seed)
    with np.load(inputs.replace("{r}", str(rank))) as data:
        return {name: data[name] for name in data.files}


def output_names(model_path: str) -> list[str]:
    return [o.name for o in load_model(model_path, load_external_data=False).graph.output]


def save_outputs(directory: str | None, rank: int, names: list[str], values: list[np.ndarray]) -> None:
    if directory is not None:
        os.makedirs(directory, exist_ok=True)
        # an output named "file" or "allow_pickle" would collide with savez's own parameters
        arrays: dict[str, Any] = dict(zip(names, values))
        np.savez(os.path.join(directory, f"rank{rank}.npz"), **arrays)


def summary(rank: int, names: list[str], values: list[np.ndarray]) -> str:
    parts = [
        f"{n} {list(v.shape)} {v.dtype} sum={float(np.asarray(v, np.float64).sum()):.6g}" for n, v in zip(names, values)
    ]
    return f"rank {rank}: " + "; ".join(parts)


def run_with_threads(
    model: str, ranks: int, inputs: str | None, outputs: str | None, seed: int, timeout: float, echo=print
) -> list[list[np.ndarray]]:
    paths = [rank_model_path(model, r) for r in range(ranks)]
    feeds = [rank_feeds(p, inputs, r, seed) for r, p in enumerate(paths)]
    echo(f"running {ranks} ranks as threads ...")
    start = time.perf_counter()
    results = run_threads(
        paths, feeds, timeout, on_done=lambda r, _: echo(f"  rank {r} done ({time.perf_counter() - start:.2f} s)")
    )
    for r, values in enumerate(results):
        names = output_names(paths[r])
        save_outputs(outputs, r, names, values)
        echo(summary(r, names, values))
    return results


def mpiexec() -> str:
    beside = os.path.join(sysconfig.get_path("scripts"), "mpiexec")
    return beside if os.path.exists(beside) else (shutil.which("mpiexec") or "mpiexec")


def run_with_mpi(
    model: str, ranks: int, inputs: str | None, outputs: str | None, seed: int, timeout: float, echo=print
) -> int:
    """Launch ``ranks`` processes under mpiexec; returns the job's exit code."""
    command = [
        mpiexec(),
        "--oversubscribe",
        "-n",
        str(ranks),
        sys.executable,
        "-m",
        "moe_onnx.cli",
        "run",
        model,
        "--ranks",
        str(ranks),
        "--backend",
        "mpi",
        "--rank-process",
        "--seed",
        str(seed),
        "--timeout",
        str(timeout),
    ]
    if inputs:
        command += ["--inputs", inputs]
    if outputs:
        command += ["--outputs", outputs]
    env = dict(os.environ)
    if hasattr(os, "geteuid") and os.geteuid() == 0:  # containers and CI run as root
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    echo(f"running {ranks} ranks under mpiexec ...")
    try:
        return subprocess.run(command, env=env, timeout=timeout + 60).returncode
    except subprocess.TimeoutExpired:
        echo(f"mpiexec did not finish within {timeout + 60:.0f} s; it was stopped")
        return 124


def mpi_rank_main(model: str, inputs: str | None, outputs: str | None, seed: int, timeout: float) -> int:
    """One MPI rank: run, save, report; on failure tell the other ranks and end the job."""
    communicator = MpiCommunicator(timeout=timeout)
    rank = communicator.rank
    try:
        path = rank_model_path(model, rank)
        session = InferenceSession(path, context={"communicator": communicator})
        values = session.run(None, rank_feeds(path, inputs, rank, seed))
        names = output_names(path)
        save_outputs(outputs, rank, names, values)
        print(summary(rank, names, values), flush=True)
        communicator.allgather(None)  # nobody leaves while a peer may still need it
        return 0
    except BaseException as exc:  # noqa: BLE001 - reported, then the job ends
        print(f"rank {rank}: error: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        communicator.abort(f"rank {rank} failed: {exc}")
        return 1
