"""One MPI job running several converted exports in turn (tests/test_converter_corpus.py).

usage: mpiexec -n N python tests/mpi_corpus_job.py OUT DIR...   (each DIR holds rank{r}.onnx and
rank{r}_inputs.npz; rank r writes OUT/<DIR name>/rank{r}.npz). It does per model what
``moe-onnx run DIR --backend mpi`` does per job (moe_onnx.commands.launch), in one job to save the
start-up of one mpiexec per model.
"""

from __future__ import annotations

import os
import sys

from moe_onnx import InferenceSession
from moe_onnx.commands.launch import output_names, rank_feeds, rank_model_path, save_outputs
from moe_onnx.ranks import END_OF_RUN, MpiCommunicator


def main(out: str, directories: list[str]) -> int:
    communicator = MpiCommunicator(timeout=120)
    rank = communicator.rank
    try:
        for directory in directories:
            path = rank_model_path(directory, rank)
            session = InferenceSession(path, context={"communicator": communicator})
            values = session.run(None, rank_feeds(path, os.path.join(directory, "rank{r}_inputs.npz"), rank, 0))
            save_outputs(os.path.join(out, os.path.basename(directory)), rank, output_names(path), values)
        communicator.allgather(None, END_OF_RUN)  # nobody leaves while a peer may still need it
        return 0
    except BaseException as exc:  # noqa: BLE001 - reported, then the job ends
        print(f"rank {rank}: error: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        communicator.abort(f"rank {rank} failed: {exc}")
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))
