"""Starting N gloo ranks for the torch frontend's tests."""

from __future__ import annotations

import multiprocessing.forkserver
import os
import tempfile

import torch.multiprocessing as mp

#: imported once by the fork server, so that no rank imports torch again
PRELOAD = [
    "torch",
    "torch.distributed",
    "moe_onnx.torch",
    "tests.torch_ep_layer",
    "tests.torch_collectives_worker",
    "tests.torch_peers_worker",
    "tests.torch_legacy_worker",
    "tests.torch_mc2_worker",
    "tests.torch_groups_worker",
    "tests.moe_chain",
    "tests.omni_chain",
    "tests.recipe_chain_export",
    "tests.ep_permute_export",
    "tests.vllm_ascend",
]


def start_ranks(worker, nprocs: int, *args, directory: str) -> None:
    """Run ``worker(rank, nprocs, init_file, *args)`` on ``nprocs`` processes; ``init_file`` is
    the gloo rendezvous (``file://``) in ``directory``. Raises if a rank fails.

    The ranks fork from a fork server: a plain fork of the test process (which has
    onnxruntime, gloo and torch threads by then) can hang in a lock a vanished thread held,
    and spawn would import torch in every rank.
    """
    multiprocessing.forkserver.set_forkserver_preload(PRELOAD)  # takes effect when the server starts
    fd, init_file = tempfile.mkstemp(prefix="gloo_", dir=directory)
    os.close(fd)
    os.unlink(init_file)
    mp.start_processes(worker, args=(nprocs, init_file, *args), nprocs=nprocs, start_method="forkserver")
