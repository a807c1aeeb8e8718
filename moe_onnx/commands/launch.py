"""``moe-onnx run``: one model on N ranks, with the threads or the MPI backend.

MODEL is a file every rank runs, a folder of ``rank{r}.onnx`` files, or a path with ``{r}``
in it (:mod:`moe_onnx.ranks.rank_files`; N comes from the files, or ``--ranks`` for one file).
Inputs come from ``rank{r}.npz`` files (``--inputs`` with ``{r}``; keys are the graph's input
names, as ``moe-onnx inputs`` writes them) or a seeded example batch; each rank's outputs go
to ``DIR/rank{r}.npz`` keyed by graph output name.

MPI runs in one of two ways:

* launched: ``moe-onnx run --backend mpi`` starts ``mpiexec`` itself (``--hostfile`` and
  ``--mpiexec-args`` passed through) and watches the job;
* joined: the user's own ``mpiexec -n N`` (or ``srun``) starts N processes that each run
  ``moe-onnx run MODEL --backend mpi``; each sees that it already is a rank of an MPI job
  (:func:`in_mpi_job`) and the N form one job from ``COMM_WORLD``.

A launched job gets its own folder (:class:`MpiJob`): Open MPI's session files and
shared-memory segments go there (through ``TMPDIR``), the ranks leave progress marks there,
and the launcher removes it when the job ends, however it ends. The ranks bound every wait
they can see (``--timeout``); the launcher's watchdog bounds what they cannot: a rank that
never starts leaves its peers inside ``MPI_Init``, where no Python code runs. The launcher
reports the ranks' errors from their marks, once per job, in place of Open MPI's
``MPI_ABORT`` notice.
"""

from __future__ import annotations

import ast
import io
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import traceback
import zipfile

import numpy as np
import onnx

from ..custom_ops import TensorInfo, dtypes
from ..errors import REFUSALS, UserError
from ..interrupts import terminate_interrupts
from ..ranks import rank_files
from ..ranks.communicators import (
    END_OF_RUN,
    STARTUP,
    MpiCommunicator,
    PeerStopped,
    ThreadRanks,
    example_feeds,
    rank_list,
)
from ..runtime.session import InferenceSession, load_model
from . import model_files

#: rank r's model file of MODEL (kept under this name for the scripts that import it)
rank_model_path = rank_files.rank_path

#: the collective in which MPI ranks share whether their model, inputs and session are ready
PREPARED = "preparation"

#: said with a refusal of inputs moe-onnx made up, so nobody takes them for the user's
GENERATED_HINT = (
    "(these inputs were generated from the graph's input types: give your own with --inputs; "
    "`moe-onnx inputs MODEL DIR` writes ones to edit)"
)

#: op types whose nodes talk to other ranks: a single model file with one needs --ranks
COLLECTIVES = {("cann.moe", "AllToAll"), ("cann.moe", "AllGather"), ("com.microsoft", "AllToAll")}


def rank_inputs_path(inputs: str, rank: int) -> str:
    return inputs.replace("{r}", str(rank))


def check_model(path: str) -> onnx.ModelProto:
    """The model at ``path`` (external data left in its files); a file that is not an ONNX
    model, or keeps external data outside its folder, is refused (protobuf reads an empty
    file as an empty model)."""
    if not os.path.isfile(path):
        raise UserError(f"model file {path} does not exist")
    try:
        model = load_model(path, load_external_data=False)
    except Exception as exc:  # protobuf's DecodeError names no file
        raise UserError(f"{path} is not an ONNX model: {type(exc).__name__}: {exc}") from exc
    if not model.HasField("graph") or not model.opset_import:
        raise UserError(f"{path} is not an ONNX model: it has no graph or no opset (an empty file?)")
    model_files.check_external_locations(path, model_files.external_locations(model))
    return model


def collectives_in(model: onnx.ModelProto) -> list[str]:
    return sorted({f"{n.domain}::{n.op_type}" for n in model.graph.node if (n.domain, n.op_type) in COLLECTIVES})


def model_paths(model: str, ranks: int | None) -> list[str]:
    """Each rank's model file, after checking MODEL and ``--ranks`` agree (:class:`UserError`).

    One file without ``--ranks`` runs on one rank, unless it has a collective (then N is
    something only the user knows)."""
    count = rank_files.rank_count(model, ranks)
    if count is None:
        found = collectives_in(check_model(model))
        if found:
            raise UserError(
                f"MODEL {model} is one file with collectives ({', '.join(found)}): say how many ranks run it "
                "with --ranks N (or give a folder of rank{r}.onnx)"
            )
        count = 1
    return [rank_files.rank_path(model, r) for r in range(count)]


def check_inputs(inputs: str | None, ranks: int) -> None:
    if inputs is None:
        return
    if not rank_files.is_pattern(inputs) and ranks > 1:
        raise UserError(f"--inputs {inputs} has no {{r}}: give one file per rank, e.g. in/rank{{r}}.npz")
    for rank in range(ranks):
        if not os.path.isfile(rank_inputs_path(inputs, rank)):
            raise UserError(f"rank {rank}: inputs file {rank_inputs_path(inputs, rank)} does not exist")


def load_inputs(path: str) -> dict[str, np.ndarray]:
    """The arrays of a ``.npz`` file, by name; :class:`UserError` for anything else."""
    if not zipfile.is_zipfile(path):
        with open(path, "rb") as f:
            is_npy = f.read(6) == b"\x93NUMPY"
        what = "a .npy file (one array, no names)" if is_npy else "not a .npz archive"
        raise UserError(
            f"inputs file {path} is {what}: --inputs takes .npz files keyed by graph input names, "
            "written by np.savez(path, name=array, ...) or `moe-onnx inputs MODEL DIR`"
        )
    try:
        with np.load(path, allow_pickle=False) as data:
            return {name: _array(data, name) for name in data.files}
    except ValueError as exc:  # object arrays: numpy's message suggests allow_pickle, which we never use
        if "pickle" in str(exc):
            raise UserError(f"inputs file {path} holds object arrays: only numeric arrays can be fed") from exc
        raise UserError(f"inputs file {path} is not a readable .npz of arrays: {exc}") from exc
    except Exception as exc:  # a truncated or corrupt archive
        raise UserError(f"inputs file {path} is not a readable .npz of arrays: {type(exc).__name__}: {exc}") from exc


def _array(archive, name: str) -> np.ndarray:
    """Entry ``name`` of an open ``.npz``. numpy writes a float8e5m2 array (ml_dtypes) with the
    header ``'<f1'``, which it cannot read back: such an entry is read as its bytes (void), and
    :func:`typed_feeds` views it as the graph input's type."""
    try:
        return archive[name]
    except ValueError as exc:
        if "descr" not in str(exc):
            raise
        with archive.zip.open(f"{name}.npy") as member:
            version = np.lib.format.read_magic(member)
            size = int.from_bytes(member.read(2 if version == (1, 0) else 4), "little")
            header = ast.literal_eval(member.read(size).decode("latin1"))
            itemsize = int(re.sub(r"\D", "", header["descr"]) or 0)
            if not itemsize or header["fortran_order"]:
                raise
            raw = np.frombuffer(member.read(), np.dtype(f"V{itemsize}"))
            return raw.reshape(header["shape"])


def rank_feeds(model, inputs: str | None, rank: int, seed: int) -> dict[str, np.ndarray]:
    """Rank ``rank``'s feeds: from its inputs file, or a seeded example batch for ``model``
    (a ModelProto or a path)."""
    if inputs is None:
        try:
            return example_feeds(model, rank, seed)
        except ValueError as exc:  # an input type the example batch cannot make
            raise UserError(str(exc)) from exc
    return typed_feeds(model, load_inputs(rank_inputs_path(inputs, rank)))


def typed_feeds(model, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``feeds`` with each array numpy stored as raw bytes viewed as its graph input's element
    type: ``np.save`` writes bfloat16 and float8 (ml_dtypes) arrays as void ``V2`` / ``V1``,
    and reads them back so. Any other array is left for the session to check."""
    graph_inputs = load_model(model, load_external_data=False).graph.input
    typed = dict(feeds)
    for value_info in graph_inputs:
        value = typed.get(value_info.name)
        element = TensorInfo.from_type_proto(value_info.type).dtype
        if value is None or element is None or value.dtype.kind != "V" or value.dtype.fields is not None:
            continue
        if value.dtype.itemsize == dtypes.numpy_dtype(element).itemsize:
            typed[value_info.name] = value.view(dtypes.numpy_dtype(element))
    return typed


def write_input_templates(model: str, ranks: int | None, folder: str, seed: int, echo=print) -> list[str]:
    """``folder/rank{r}.npz`` for every rank: the seeded example batch, keyed by graph input
    name, for the user to edit and pass as ``--inputs folder/rank{r}.npz``."""
    paths = model_paths(model, ranks)
    rank_files.check_output_folder(folder, "DIR")
    written = []
    for rank, path in enumerate(paths):
        feeds = rank_feeds(check_model(path), None, rank, seed)
        target = save_arrays(folder, f"rank{rank}.npz", feeds)
        echo(f"wrote {target}: " + "; ".join(f"{k} {list(v.shape)} {v.dtype}" for k, v in feeds.items()))
        written.append(target)
    pattern = os.path.join(folder, "rank{r}.npz")
    echo(f"edit them (keys = graph input names), then: moe-onnx run {model} --inputs '{pattern}'")
    return written


def output_names(model) -> list[str]:
    """Graph output names of ``model`` (a ModelProto or a path)."""
    return [o.name for o in load_model(model, load_external_data=False).graph.output]


def save_arrays(directory: str, name: str, arrays: dict[str, np.ndarray]) -> str:
    """``directory/name``, one ``.npy`` entry per array as ``np.savez`` writes them, but any
    key works (``np.savez(path, **arrays)`` breaks on ``file`` or ``allow_pickle``). Written
    under a temporary name and renamed into place."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, name)
    handle, partial = tempfile.mkstemp(prefix=f".{name}.", suffix=".npz", dir=directory)
    try:
        with os.fdopen(handle, "wb") as f, zipfile.ZipFile(f, "w", zipfile.ZIP_STORED, allowZip64=True) as archive:
            for key, value in arrays.items():
                buffer = io.BytesIO()
                value = np.asanyarray(value)
                if dtypes.name_of(value) in dtypes.ML_DTYPES:  # as bytes numpy reads back (typed_feeds)
                    value = value.view(f"V{value.dtype.itemsize}")
                np.lib.format.write_array(buffer, value, allow_pickle=False)
                archive.writestr(key + ".npy", buffer.getvalue())
        os.replace(partial, path)
    except BaseException:
        os.remove(partial)
        raise
    return path


def save_outputs(directory: str | None, rank: int, names: list[str], values: list[np.ndarray]) -> None:
    """``directory/rank{rank}.npz`` keyed by output name (nothing without a directory)."""
    if directory is not None:
        save_arrays(directory, f"rank{rank}.npz", dict(zip(names, values)))


def summary(rank: int, names: list[str], values: list[np.ndarray]) -> str:
    parts = [
        f"{n} {list(v.shape)} {v.dtype} sum={float(np.asarray(v, np.float64).sum()):.6g}" for n, v in zip(names, values)
    ]
    return f"rank {rank}: " + "; ".join(parts)


# --- errors, once per job ----------------------------------------------------------------


def exit_code(errors: dict[int, BaseException]) -> int:
    """2 when the ranks that failed first refused what they were given, else 1 (peers that
    stopped because another rank failed do not count)."""
    first = [e for e in errors.values() if not isinstance(e, PeerStopped)]
    return 2 if first and all(isinstance(e, REFUSALS) for e in first) else 1


def error_line(rank: int, error: BaseException) -> str:
    return f"rank {rank}: error: {type(error).__name__}: {error}"


#: what makes one cause read differently on each rank: who reported it, which rank stopped
_PER_RANK = re.compile(r" \(reported by rank \d+\)|^rank \d+ stopped: ")


def error_lines(failures: dict[int, tuple[str, str, bool]], generated: bool = False) -> list[str]:
    """One line per cause: ``failures`` maps rank -> (error type, message, peer stopped), and
    ranks whose messages differ only by who reported the cause share a line. Ranks that
    stopped because a peer failed are named on the cause's line, not on lines of their own."""
    first = {r: f for r, f in failures.items() if not f[2]} or failures
    causes: dict[str, list[int]] = {}
    for rank, (kind, message, _) in sorted(first.items()):
        causes.setdefault(f"{kind}: {_PER_RANK.sub('', message)}", []).append(rank)
    lines = [f"{rank_list(ranks)}: error: {cause}" for cause, ranks in causes.items()]
    if generated and any(kind in ("MoeOpError", "FeedError") for kind, _, _ in first.values()):
        lines[-1] += " " + GENERATED_HINT
    stopped = sorted(set(failures) - set(first))
    if stopped:
        lines[-1] += f" ({rank_list(stopped)} stopped because of it)"
    return lines


def _failure(error: BaseException) -> tuple[str, str, bool]:
    return type(error).__name__, str(error), isinstance(error, PeerStopped)


def _is_refusal(error: BaseException) -> bool:
    return isinstance(error, REFUSALS)


# --- threads -----------------------------------------------------------------------------


class ThreadsFailed(Exception):
    """Some ranks failed; ``lines`` say why (once per cause), ``code`` is the exit code."""

    def __init__(self, lines: list[str], code: int, errors: dict[int, BaseException]):
        super().__init__("\n".join(lines))
        self.lines, self.code, self.errors = lines, code, errors


def run_with_threads(
    model: str,
    ranks: int | None,
    inputs: str | None,
    outputs: str | None,
    seed: int,
    timeout: float,
    echo=print,
) -> list[list[np.ndarray]]:
    """Run every rank as a thread of this process; raises :class:`ThreadsFailed`."""
    from ..ranks.communicators import RankFailure

    paths = model_paths(model, ranks)
    check_inputs(inputs, len(paths))
    models = [check_model(path) for path in paths]  # (sessions load from the paths: external data)
    feeds = [rank_feeds(m, inputs, r, seed) for r, m in enumerate(models)]
    start = time.perf_counter()
    echo(f"running {len(paths)} rank(s) as threads ...", flush=True)

    def ready(rank: int) -> None:
        echo(f"  rank {rank}: session ready ({time.perf_counter() - start:.2f} s)", flush=True)

    def done(rank: int, _values) -> None:
        echo(f"  rank {rank}: done ({time.perf_counter() - start:.2f} s)", flush=True)

    try:
        world = ThreadRanks(paths, timeout, on_ready=ready)
        try:
            results = world.run(feeds, on_done=done)
        except KeyboardInterrupt:
            world.world.abort("interrupted")  # ranks waiting in a collective stop at once
            raise
    except RankFailure as failure:
        errors = failure.errors
        lines = error_lines({r: _failure(e) for r, e in errors.items()}, generated=inputs is None)
        raise ThreadsFailed(lines, exit_code(errors), errors) from failure
    for r, values in enumerate(results):
        names = output_names(models[r])
        save_outputs(outputs, r, names, values)
        echo(summary(r, names, values))
    return results


# --- MPI -------------------------------------------------------------------------------

#: the job's folder, in the environment of every process of the job (how the ranks find
#: where to leave their marks, and how the launcher finds the job's processes)
JOB_FOLDER = "MOE_ONNX_MPI_JOB"

#: set in a process that is one rank of an MPI job: Open MPI's mpiexec, PMIx (Open MPI 5,
#: srun --mpi=pmix) and PMI-2 (srun --mpi=pmi2, MPICH's Hydra)
_RANK_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE")

#: where Open MPI's notices start and end
_RULE = re.compile(r"^-{20,}\s*$")
#: notices that only say the job ended because a rank aborted or exited with an error code,
#: which the launcher says itself (from the ranks' marks)
_ENDED_NOTICES = ("MPI_ABORT was invoked", "exited due to process rank", "exited with non-zero status")


def in_mpi_job() -> bool:
    """Whether this process was started as a rank of an MPI job (mpiexec, srun)."""
    return any(variable in os.environ for variable in _RANK_VARIABLES)


class NoticeFilter:
    """Copies mpiexec's stderr to ours, holding back Open MPI's notices that a rank aborted or
    exited with an error (blocks between rules of dashes): the launcher names the ranks and
    the cause itself. Held-back notices are written by :meth:`release` when it could not."""

    def __init__(self, stream, out=None):
        self.out = out or sys.stderr
        self.held: list[str] = []
        self.thread = threading.Thread(target=self._copy, args=(stream,), name="mpiexec-stderr", daemon=True)
        self.thread.start()

    def _copy(self, stream) -> None:
        block: list[str] | None = None
        for line in iter(stream.readline, ""):
            line = line.replace("\0", "")  # prterun writes a NUL byte when a job ends with an error
            if not line:
                continue
            if block is None:
                if _RULE.match(line):
                    block = [line]
                else:
                    self._write(line)
                continue
            block.append(line)
            if _RULE.match(line) and len(block) > 1:
                self._block(block)
                block = None
        if block:
            self._block(block)

    def _block(self, block: list[str]) -> None:
        text = "".join(block)
        if any(notice in " ".join(text.split()) for notice in _ENDED_NOTICES):
            self.held.append(text)
        else:
            self._write(text)

    def _write(self, text: str) -> None:
        self.out.write(text)
        self.out.flush()

    def finish(self, timeout: float = 5.0) -> None:
        self.thread.join(timeout)

    def release(self) -> None:
        for text in self.held:
            self._write(text)
        self.held = []


class MpiJob:
    """One ``mpiexec`` run: its folder, its watchdog, its cleanup, its report.

    The ranks leave marks in ``FOLDER/marks``: ``started`` (before MPI starts), ``ready``
    (past the startup barrier), ``done`` (past the end-of-run collective) or ``failed`` (with
    the error, as JSON). The watchdog stops the job (every process of it, by pid) when

    * not every rank is ready ``timeout`` + 1 s after the first one started (a rank stopped
      before or inside ``MPI_Init`` holds its peers there, out of their deadlines' reach);
    * a rank is done and the job has not ended ``timeout`` + 1 s later (one stuck in
      ``MPI_Finalize``);
    * a rank failed and the job has not ended 4 s later (its abort takes 1 s).

    With ranks on other hosts (``local=False``) only this host's ranks can leave marks, so
    the first rule is off: the ranks' own deadlines and mpiexec bound those jobs.
    """

    def __init__(self, ranks: int, timeout: float, echo=print, local: bool = True):
        self.ranks = ranks
        self.timeout = timeout
        self.echo = echo
        self.local = local
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

    def failures(self) -> dict[int, tuple[str, str, bool]]:
        """rank -> (error type, message, peer stopped) from the ranks' ``failed`` marks."""
        found = {}
        for rank in self.marks()["failed"]:
            try:
                with open(os.path.join(self.marks_folder, f"rank{rank}.failed")) as f:
                    kind, message, peer = json.load(f)[:3]  # (then whether it refused: failure_code)
                found[rank] = (str(kind), str(message), bool(peer))
            except (OSError, ValueError, TypeError):
                found[rank] = ("Error", "(its report could not be read)", False)
        return found

    def failure_code(self) -> int:
        """The job's exit code from the ranks' ``failed`` marks: 2 when every rank that failed
        first (not stopped by a peer) refused what it was given, else 1. mpiexec's own code is
        that of whichever rank's ``MPI_Abort`` came first, which may be a peer's (1)."""
        first = []
        for rank in self.marks()["failed"]:
            try:
                with open(os.path.join(self.marks_folder, f"rank{rank}.failed")) as f:
                    record = json.load(f)
            except (OSError, ValueError):
                record = []
            if len(record) < 3 or not record[2]:  # (unreadable: a failure of its own)
                first.append(len(record) > 3 and bool(record[3]))
        return 2 if first and all(first) else 1

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

    def run(self, command: list[str], generated: bool = False) -> int:
        process = subprocess.Popen(
            command, env=self.environment(), start_new_session=True, stderr=subprocess.PIPE, text=True, errors="replace"
        )
        notices = NoticeFilter(process.stderr)
        try:
            with terminate_interrupts():  # SIGTERM too stops the job and removes its folder
                code = self._watch(process)
        finally:
            if process.poll() is None:
                self._stop(process)
            notices.finish()
        failures = self.failures()
        if any(not peer for _, _, peer in failures.values()):  # a rank said why it failed
            for line in error_lines(failures, generated):
                self.echo(line, file=sys.stderr, flush=True)
            return code if code == 124 else self.failure_code()
        notices.release()
        if code not in (0, 124):  # no rank's own failure: one died, or all were stopped
            self._explain(code)
            return 1  # a run that failed; mpiexec's own code (213, ...) is named in the line, not passed on
        return code

    def _watch(self, process: subprocess.Popen) -> int:
        first: dict[str, float] = {}  # state -> when the first rank left that mark
        pids: dict[int, int] = {}  # rank -> pid, as the ranks' processes appear
        self._vanished: list[set[int]] = []  # ranks whose process ended without a report, per look
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
            reported = marks["done"] | marks["failed"] | set().union(*self._vanished)
            gone = {r for r, pid in pids.items() if r not in reported and _process_state(pid) in (None, "Z")}
            if gone:
                self._vanished.append(gone)
            time.sleep(0.05)
        return process.returncode

    def _explain(self, code: int) -> None:
        marks = self.marks()
        if self._vanished:
            why = f"{rank_list(self._vanished[0])} ended first, without a report (killed or crashed)"
        else:
            silent = set(range(self.ranks)) - marks["done"]
            why = f"the job ended before {rank_list(silent)} reported (killed or crashed: see mpiexec's message)"
        self.echo(f"error: {why}; mpiexec exited with code {code}", file=sys.stderr, flush=True)

    def _overdue(self, marks: dict[str, set[int]], first: dict[str, float], now: float) -> str | None:
        everyone = set(range(self.ranks))
        waited = f"the other ranks waited {self.timeout:g} s"
        started = first.get("started")
        # a rank that never started holds the others inside MPI_Init, out of their deadlines' reach;
        # one that started but is not ready past its deadline, 1 s later, has not been stopped by its peers
        if self.local and started is not None and everyone - marks["started"] and now > started + self.timeout:
            return f"{self.culprits(everyone - marks['started'])} never started; {waited}"
        if self.local and started is not None and marks["ready"] != everyone and now > started + self.timeout + 1:
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


#: mpiexec options that place ranks on hosts
_HOST_OPTIONS = ("--host", "-H", "--hostfile", "-hostfile", "--machinefile", "-machinefile", "--default-hostfile")


def _local_names() -> set[str]:
    names = {"localhost", "127.0.0.1", "::1"}
    for name in (socket.gethostname(), socket.getfqdn()):
        names |= {name, name.split(".")[0]}
    return names


def hostfile_hosts(path: str) -> list[str]:
    """The host names of an Open MPI hostfile (``name [slots=N] ...`` lines, ``#`` comments)."""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError as exc:
        raise UserError(f"--hostfile {path}: {exc.strerror or exc}") from exc
    hosts = [line.split("#", 1)[0].split()[0] for line in lines if line.split("#", 1)[0].strip()]
    if not hosts:
        raise UserError(f"--hostfile {path} names no host")
    return hosts


def launcher_options(hostfile: str | None, mpiexec_args: str | None) -> tuple[list[str], bool]:
    """mpiexec's options before ``-n``, and whether every rank runs on this host.

    Without a hostfile or host options the ranks run here, oversubscribed (more ranks than
    cores is what a test of N ranks on a laptop needs); with them, mpiexec places the ranks
    as told and oversubscribes only if told (``--mpiexec-args=--oversubscribe``)."""
    try:
        extra = shlex.split(mpiexec_args or "")
    except ValueError as exc:
        raise UserError(f"--mpiexec-args {mpiexec_args!r}: {exc}") from exc
    placed = hostfile is not None or any(a.split("=", 1)[0] in _HOST_OPTIONS for a in extra)
    options = ([] if placed else ["--oversubscribe"]) + (["--hostfile", hostfile] if hostfile else []) + extra
    local = not placed or (
        hostfile is not None
        and set(hostfile_hosts(hostfile)) <= _local_names()
        and not any(a.split("=", 1)[0] in _HOST_OPTIONS for a in extra)
    )
    return options, local


def run_with_mpi(
    model: str,
    ranks: int | None,
    inputs: str | None,
    outputs: str | None,
    seed: int,
    timeout: float,
    echo=print,
    debug: bool = False,
    hostfile: str | None = None,
    mpiexec_args: str | None = None,
) -> int:
    """Launch the ranks under mpiexec; returns the job's exit code (124: the watchdog
    stopped it)."""
    paths = model_paths(model, ranks)
    count = len(paths)
    check_inputs(inputs, count)
    for path in paths:
        check_model(path)
    options, local = launcher_options(hostfile, mpiexec_args)
    command = [mpiexec(), *options, "-n", str(count), sys.executable, "-m", "moe_onnx.commands.cli", "run", model]
    command += ["--ranks", str(count), "--backend", "mpi", "--rank-process", "--seed", str(seed)]
    command += ["--timeout", str(timeout)]
    if inputs:
        command += ["--inputs", inputs]
    if outputs:
        command += ["--outputs", outputs]
    if debug:
        command += ["--debug"]
    where = "" if local else " (ranks placed by the hostfile / mpiexec options)"
    echo(f"running {count} rank(s) under mpiexec{where} ...", flush=True)
    with MpiJob(count, timeout, echo, local=local) as job:
        return job.run(command, generated=inputs is None)


def _mark(state: str, text: str = "") -> bool:
    """Leave this rank's mark for the launcher's watchdog; False when there is no launcher's
    folder here (a joined job, or a rank on another host)."""
    folder = os.environ.get(JOB_FOLDER)
    rank = os.environ.get("OMPI_COMM_WORLD_RANK")
    if not folder or rank is None:
        return False
    path = os.path.join(folder, "marks", f"rank{rank}.{state}")
    try:
        with open(path + ".partial", "w") as f:
            f.write(text)
        os.replace(path + ".partial", path)  # the launcher never reads half a mark
    except OSError:
        return False
    return True


def _prepare(model: str, ranks: int | None, inputs: str | None, seed: int, communicator) -> tuple:
    """This rank's session, feeds and model, after the checks the launcher makes (which a
    joined job has not had): ``--ranks`` and MODEL's rank files agree with the job's size."""
    size, rank = communicator.size, communicator.rank
    if ranks is not None and ranks != size:
        raise UserError(f"--ranks {ranks}, but this MPI job has {size} rank(s)")
    try:
        found = rank_files.ranks_found(model)
    except UserError:
        found = None  # files missing on this host are refused below, for this rank
    if found is not None and found != size:
        raise UserError(f"MODEL {model} has {found} rank file(s), but this MPI job has {size} rank(s)")
    path = rank_files.rank_path(model, rank)
    proto = check_model(path)
    if inputs is not None and not os.path.isfile(rank_inputs_path(inputs, rank)):
        raise UserError(f"inputs file {rank_inputs_path(inputs, rank)} does not exist")
    feeds = rank_feeds(proto, inputs, rank, seed)
    session = InferenceSession(path, context={"communicator": communicator})
    return session, feeds, proto


def mpi_rank_main(
    model: str,
    ranks: int | None,
    inputs: str | None,
    outputs: str | None,
    seed: int,
    timeout: float,
    debug: bool = False,
) -> int:
    """One MPI rank: prepare, agree with the others that everyone is ready, run, save,
    report; on failure tell the other ranks and end the job.

    Errors are reported once per job: a launched job's ranks leave them in their marks for
    the launcher; in a joined job, failures before the run are shared (every rank exits with
    the same code, the lowest failed rank prints them), and a failure in the run is printed
    by the rank where it happened (not by peers that only stopped because of it)."""
    _mark("started")
    start = time.perf_counter()
    communicator = MpiCommunicator(timeout=timeout)  # MPI starts here
    rank = communicator.rank
    launched = JOB_FOLDER in os.environ

    def report(failures: dict[int, tuple[str, str, bool]], error: BaseException | None, refused: bool) -> None:
        own = failures.get(rank)
        left = own is not None and _mark("failed", json.dumps([*own, refused]))
        if debug and error is not None:
            traceback.print_exception(type(error), error, error.__traceback__)
        if launched and left:
            return  # the launcher reports it
        if own is not None and not own[2] and not re.search(r"\(reported by rank \d+\)", own[1]):
            if rank == min(failures):
                for line in error_lines(failures, generated=inputs is None):
                    print(line, file=sys.stderr, flush=True)

    try:
        communicator.allgather(None, STARTUP)  # a barrier with the deadline of every other wait
        _mark("ready")
        error: BaseException | None = None
        try:
            session, feeds, proto = _prepare(model, ranks, inputs, seed, communicator)
            verdict = None
        except Exception as exc:  # noqa: BLE001 - shared with the peers, who stop too
            error, verdict = exc, (*_failure(exc), _is_refusal(exc))
        verdicts = communicator.allgather(verdict, PREPARED)
        failed = {r: v for r, v in enumerate(verdicts) if v is not None}
        if failed:
            report({r: v[:3] for r, v in failed.items()}, error, rank in failed and failed[rank][3])
            return 2 if all(v[3] for v in failed.values()) else 1
        print(f"rank {rank}: session ready ({time.perf_counter() - start:.2f} s)", flush=True)
        values = session.run(None, feeds)
        names = output_names(proto)
        save_outputs(outputs, rank, names, values)
        print(summary(rank, names, values), flush=True)
        communicator.allgather(None, END_OF_RUN)  # nobody leaves while a peer may still need it
        _mark("done")
        print(f"rank {rank}: done ({time.perf_counter() - start:.2f} s)", flush=True)
        return 0
    except BaseException as exc:  # noqa: BLE001 - reported, then the job ends
        if isinstance(exc, KeyboardInterrupt):  # a stop from outside (Open MPI ends a job with SIGTERM), not a cause
            code, failure = 130, ("KeyboardInterrupt", f"rank {rank} interrupted ({exc or 'SIGINT'})", True)
        elif isinstance(exc, PeerStopped):  # the job ends with the cause's code, whichever Abort lands first
            code, failure = exc.code, _failure(exc)
        else:
            code, failure = exit_code({rank: exc}), _failure(exc)
        report({rank: failure}, exc, _is_refusal(exc))
        communicator.abort(f"rank {rank} failed: {exc}", code=code)
        return 1
