"""``moe-onnx run``: one model on N ranks, with the threads or the MPI backend.

MODEL is a file every rank runs, a directory of ``rank{r}.onnx`` files, or a path with
``{r}`` in it. Inputs come from ``rank{r}.npz`` files (``--inputs`` with ``{r}``) or a seeded
example batch; each rank's outputs go to ``DIR/rank{r}.npz`` keyed by graph output name.

With MPI, each job gets its own folder (:class:`MpiJob`): Open MPI's session files and
shared-memory segments go there (through ``TMPDIR``), the ranks leave progress marks there,
and the launcher removes it when the job ends, however it ends. The ranks bound every wait
they can see (``--timeout``); the launcher's watchdog bounds what they cannot: a rank that
never starts leaves its peers inside ``MPI_Init``, where no Python code runs.
"""

from __future__ import annotations

import io
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
import traceback
import zipfile

import numpy as np
import onnx

from .errors import REFUSALS, UserError
from .interrupts import terminate_interrupts
from .ranks import END_OF_RUN, STARTUP, MpiCommunicator, PeerStopped, example_feeds, rank_list, run_threads
from .session import InferenceSession, load_model


def rank_model_path(model: str, rank: int) -> str:
    if os.path.isdir(model):
        return os.path.join(model, f"rank{rank}.onnx")
    return model.replace("{r}", str(rank))


def rank_inputs_path(inputs: str, rank: int) -> str:
    return inputs.replace("{r}", str(rank))


def check_files(model: str, inputs: str | None, ranks: int) -> None:
    """Refuse a missing model or inputs file before any rank starts."""
    if ranks < 1:
        raise UserError(f"--ranks must be >= 1, got {ranks}")
    for rank in range(ranks):
        path = rank_model_path(model, rank)
        if not os.path.isfile(path):
            raise UserError(f"rank {rank}: model file {path} does not exist")
        if inputs is not None and not os.path.isfile(rank_inputs_path(inputs, rank)):
            raise UserError(f"rank {rank}: inputs file {rank_inputs_path(inputs, rank)} does not exist")


def check_model(path: str) -> onnx.ModelProto:
    """The model at ``path`` (external data left in its files); a file that is not an ONNX
    model is refused (protobuf reads an empty file as an empty model)."""
    try:
        model = load_model(path, load_external_data=False)
    except Exception as exc:  # protobuf's DecodeError names no file
        raise UserError(f"{path} is not an ONNX model: {type(exc).__name__}: {exc}") from exc
    if not model.HasField("graph") or not model.opset_import:
        raise UserError(f"{path} is not an ONNX model: it has no graph or no opset (an empty file?)")
    return model


def rank_feeds(model, inputs: str | None, rank: int, seed: int) -> dict[str, np.ndarray]:
    """Rank ``rank``'s feeds: from its inputs file, or a seeded example batch for ``model``
    (a ModelProto or a path)."""
    if inputs is None:
        return example_feeds(model, rank, seed)
    path = rank_inputs_path(inputs, rank)
    try:
        with np.load(path) as data:
            return {name: data[name] for name in data.files}
    except Exception as exc:  # not an npz, object arrays (refused: no pickles), a truncated file, ...
        raise UserError(f"inputs file {path} is not a readable .npz of arrays: {exc}") from exc


def output_names(model) -> list[str]:
    """Graph output names of ``model`` (a ModelProto or a path)."""
    return [o.name for o in load_model(model, load_external_data=False).graph.output]


def save_outputs(directory: str | None, rank: int, names: list[str], values: list[np.ndarray]) -> None:
    """``directory/rank{rank}.npz``, one ``.npy`` entry per output as ``np.savez`` writes them,
    but any output name works (``np.savez(path, **arrays)`` breaks on ``file`` or
    ``allow_pickle``). Written under a temporary name and renamed into place."""
    if directory is None:
        return
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"rank{rank}.npz")
    handle, partial = tempfile.mkstemp(prefix=f".rank{rank}.", suffix=".npz", dir=directory)
    try:
        with os.fdopen(handle, "wb") as f, zipfile.ZipFile(f, "w", zipfile.ZIP_STORED, allowZip64=True) as archive:
            for name, value in zip(names, values):
                buffer = io.BytesIO()
                np.lib.format.write_array(buffer, np.asanyarray(value), allow_pickle=False)
                archive.writestr(name + ".npy", buffer.getvalue())
        os.replace(partial, path)
    except BaseException:
        os.remove(partial)
        raise


def summary(rank: int, names: list[str], values: list[np.ndarray]) -> str:
    parts = [
        f"{n} {list(v.shape)} {v.dtype} sum={float(np.asarray(v, np.float64).sum()):.6g}" for n, v in zip(names, values)
    ]
    return f"rank {rank}: " + "; ".join(parts)


def run_with_threads(
    model: str, ranks: int, inputs: str | None, outputs: str | None, seed: int, timeout: float, echo=print
) -> list[list[np.ndarray]]:
    check_files(model, inputs, ranks)
    paths = [rank_model_path(model, r) for r in range(ranks)]
    models = [check_model(path) for path in paths]  # (sessions load from the paths: external data)
    feeds = [rank_feeds(m, inputs, r, seed) for r, m in enumerate(models)]
    echo(f"running {ranks} ranks as threads ...")
    start = time.perf_counter()
    results = run_threads(
        paths, feeds, timeout, on_done=lambda r, _: echo(f"  rank {r} done ({time.perf_counter() - start:.2f} s)")
    )
    for r, values in enumerate(results):
        names = output_names(models[r])
        save_outputs(outputs, r, names, values)
        echo(summary(r, names, values))
    return results


def exit_code(errors: dict[int, BaseException]) -> int:
    """2 when the ranks that failed first refused what they were given, else 1 (peers that
    stopped because another rank failed do not count)."""
    first = [e for e in errors.values() if not isinstance(e, PeerStopped)]
    return 2 if first and all(isinstance(e, REFUSALS) for e in first) else 1


def error_line(rank: int, error: BaseException) -> str:
    return f"rank {rank}: error: {type(error).__name__}: {error}"


# --- MPI -------------------------------------------------------------------------------

#: the job's folder, in the environment of every process of the job (how the ranks find
#: where to leave their marks, and how the launcher finds the job's processes)
JOB_FOLDER = "MOE_ONNX_MPI_JOB"


class MpiJob:
    """One ``mpiexec`` run: its folder, its watchdog, its cleanup.

    The ranks leave marks in ``FOLDER/marks``: ``started`` (before MPI starts), ``ready``
    (past the startup barrier), ``done`` (past the end-of-run collective) or ``failed``. The
    watchdog stops the job (every process of it, by pid) when

    * not every rank is ready ``timeout`` + 1 s after the first one started (a rank stopped
      before or inside ``MPI_Init`` holds its peers there, out of their deadlines' reach);
    * a rank is done and the job has not ended ``timeout`` + 1 s later (one stuck in
      ``MPI_Finalize``);
    * a rank failed and the job has not ended 4 s later (its abort takes 1 s).
    """

    def __init__(self, ranks: int, timeout: float, echo=print):
        self.ranks = ranks
        self.timeout = timeout
        self.echo = echo
        self.folder = tempfile.mkdtemp(prefix="moe_onnx_mpi_")
        self.marks_folder = os.path.join(self.folder, "marks")
        self.tmp_folder = os.path.join(self.folder, "tmp")
        os.mkdir(self.marks_folder)
        os.mkdir(self.tmp_folder)

    def __enter__(self) -> MpiJob:
        return self

    def __exit__(self, *exc_info) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env[JOB_FOLDER] = self.folder
        env["TMPDIR"] = self.tmp_folder  # Open MPI's session folder (ompi.*) goes there
        env["OMPI_MCA_btl_sm_backing_directory"] = self.tmp_folder  # and its shared-memory segments
        if hasattr(os, "geteuid") and os.geteuid() == 0:  # containers and CI run as root
            env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        return env

    def marks(self) -> dict[str, set[int]]:
        """state -> the ranks that left that mark."""
        found: dict[str, set[int]] = {"started": set(), "ready": set(), "done": set(), "failed": set()}
        for name in os.listdir(self.marks_folder):
            rank, _, state = name.removeprefix("rank").partition(".")
            if rank.isdigit() and state in found:
                found[state].add(int(rank))
        return found

    def processes(self) -> dict[int, int]:
        """rank -> pid of the job's rank processes, found by the job folder in their environment."""
        found = {}
        marker = f"{JOB_FOLDER}={self.folder}".encode()
        for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    environ = f.read().split(b"\0")
            except OSError:
                continue
            if marker in environ:
                for item in environ:
                    if item.startswith(b"OMPI_COMM_WORLD_RANK="):
                        found[int(item.split(b"=", 1)[1])] = int(entry)
        return found

    def culprits(self, ranks: set[int]) -> str:
        """Those of ``ranks`` whose process is stopped (e.g. by SIGSTOP), named as such, or
        else all of ``ranks``."""
        processes = self.processes()
        stopped = [r for r in ranks if _process_state(processes.get(r)) == "T"]
        if stopped:
            return f"{rank_list(stopped)} (stopped, e.g. by SIGSTOP)"
        return rank_list(ranks)

    def run(self, command: list[str]) -> int:
        process = subprocess.Popen(command, env=self.environment(), start_new_session=True)
        try:
            with terminate_interrupts():  # SIGTERM too stops the job and removes its folder
                return self._watch(process)
        finally:
            if process.poll() is None:
                self._stop(process)

    def _watch(self, process: subprocess.Popen) -> int:
        first: dict[str, float] = {}  # state -> when the first rank left that mark
        pids: dict[int, int] = {}  # rank -> pid, as the ranks' processes appear
        vanished: list[set[int]] = []  # ranks whose process ended without a report, per look
        while process.poll() is None:
            now = time.monotonic()
            marks = self.marks()
            for state, ranks in marks.items():
                if ranks:
                    first.setdefault(state, now)
            problem = self._overdue(marks, first, now)
            if problem:
                self.echo(f"error: {problem}; the job was stopped", file=sys.stderr, flush=True)
                self._stop(process)
                return 124
            pids.update(self.processes())
            reported = marks["done"] | marks["failed"] | set().union(*vanished)
            gone = {r for r, pid in pids.items() if r not in reported and _process_state(pid) in (None, "Z")}
            if gone:
                vanished.append(gone)
            time.sleep(0.05)
        code = process.returncode
        marks = self.marks()
        if code != 0 and not marks["failed"]:
            if vanished:
                why = f"{rank_list(vanished[0])} ended first, without a report (killed or crashed)"
            else:
                silent = set(range(self.ranks)) - marks["done"]
                why = f"the job ended before {rank_list(silent)} reported (killed or crashed: see mpiexec's message)"
            self.echo(f"error: {why}", file=sys.stderr, flush=True)
        return code

    def _overdue(self, marks: dict[str, set[int]], first: dict[str, float], now: float) -> str | None:
        everyone = set(range(self.ranks))
        waited = f"the other ranks waited {self.timeout:g} s"
        started = first.get("started")
        # a rank that never started holds the others inside MPI_Init, out of their deadlines' reach;
        # one that started but is not ready past its deadline, 1 s later, has not been stopped by its peers
        if started is not None and everyone - marks["started"] and now > started + self.timeout:
            return f"{self.culprits(everyone - marks['started'])} never started; {waited}"
        if started is not None and marks["ready"] != everyone and now > started + self.timeout + 1:
            return f"{self.culprits(everyone - marks['ready'])} did not get through MPI startup; {waited}"
        if "done" in first and now > first["done"] + self.timeout + 1:
            return f"{self.culprits(set(self.processes()))} did not exit {self.timeout:g} s after the end of the run"
        if "failed" in first and now > first["failed"] + 4:
            return f"{rank_list(marks['failed'])} failed and the job did not end within 4 s"
        return None

    def _stop(self, process: subprocess.Popen) -> None:
        """Kill every process of the job: Open MPI puts each rank in a process group of its own."""
        for pid in self.processes().values():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()


def _process_state(pid: int | None) -> str | None:
    """The state letter of /proc/PID/stat (R, S, T for stopped, ...), None without a process."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def mpiexec() -> str:
    beside = os.path.join(sysconfig.get_path("scripts"), "mpiexec")
    return beside if os.path.exists(beside) else (shutil.which("mpiexec") or "mpiexec")


def run_with_mpi(
    model: str,
    ranks: int,
    inputs: str | None,
    outputs: str | None,
    seed: int,
    timeout: float,
    echo=print,
    debug: bool = False,
) -> int:
    """Launch ``ranks`` processes under mpiexec; returns the job's exit code (124: the
    watchdog stopped it)."""
    check_files(model, inputs, ranks)
    for r in range(ranks):
        check_model(rank_model_path(model, r))
    command = [mpiexec(), "--oversubscribe", "-n", str(ranks), sys.executable, "-m", "moe_onnx.cli", "run", model]
    command += ["--ranks", str(ranks), "--backend", "mpi", "--rank-process", "--seed", str(seed)]
    command += ["--timeout", str(timeout)]
    if inputs:
        command += ["--inputs", inputs]
    if outputs:
        command += ["--outputs", outputs]
    if debug:
        command += ["--debug"]
    echo(f"running {ranks} ranks under mpiexec ...")
    with MpiJob(ranks, timeout, echo) as job:
        return job.run(command)


def _mark(state: str, text: str = "") -> None:
    """Leave this rank's mark for the launcher's watchdog (nothing without a launcher)."""
    folder = os.environ.get(JOB_FOLDER)
    rank = os.environ.get("OMPI_COMM_WORLD_RANK")
    if folder and rank is not None:
        path = os.path.join(folder, "marks", f"rank{rank}.{state}")
        with open(path + ".partial", "w") as f:
            f.write(text)
        os.replace(path + ".partial", path)  # the launcher never reads half a mark


def mpi_rank_main(
    model: str, inputs: str | None, outputs: str | None, seed: int, timeout: float, debug: bool = False
) -> int:
    """One MPI rank: run, save, report; on failure tell the other ranks and end the job."""
    _mark("started")
    communicator = MpiCommunicator(timeout=timeout)  # MPI starts here
    rank = communicator.rank
    try:
        communicator.allgather(None, STARTUP)  # a barrier with the deadline of every other wait
        _mark("ready")
        path = rank_model_path(model, rank)
        proto = check_model(path)
        session = InferenceSession(path, context={"communicator": communicator})
        values = session.run(None, rank_feeds(proto, inputs, rank, seed))
        names = output_names(proto)
        save_outputs(outputs, rank, names, values)
        print(summary(rank, names, values), flush=True)
        communicator.allgather(None, END_OF_RUN)  # nobody leaves while a peer may still need it
        _mark("done")
        return 0
    except BaseException as exc:  # noqa: BLE001 - reported, then the job ends
        print(error_line(rank, exc), file=sys.stderr, flush=True)
        if debug:
            traceback.print_exc()
        _mark("failed", str(exc))
        communicator.abort(f"rank {rank} failed: {exc}", code=exit_code({rank: exc}))
        return 1
