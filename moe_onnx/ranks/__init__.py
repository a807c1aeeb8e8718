"""Ranks: the communicators (threads, MPI) behind the collectives, running one model on N ranks
(:func:`run_threads`), and the rank files a folder of per-rank models is named by
(:mod:`.rank_files`). ``moe-onnx run``'s launcher, which uses both, is
:mod:`moe_onnx.commands.launch`."""

from .communicators import (
    END_OF_RUN,
    CollectiveMismatch,
    MpiCommunicator,
    PeerStopped,
    RankFailure,
    ThreadRanks,
    ThreadWorld,
    run_threads,
)

__all__ = [
    "END_OF_RUN",
    "CollectiveMismatch",
    "MpiCommunicator",
    "PeerStopped",
    "RankFailure",
    "ThreadRanks",
    "ThreadWorld",
    "run_threads",
]
