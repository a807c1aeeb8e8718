"""One MPI job running several sharded models in turn (tests/test_shard.py), bfloat16 included.

usage: mpiexec -n N python tests/mpi_shard_job.py DIR...   (each DIR holds rank{r}.onnx and
in{r}.npz with ``x`` as its bits, uint16 for bfloat16: npz has no bfloat16; rank r writes
DIR/out{r}.npy, bits likewise). What ``moe-onnx run DIR --backend mpi`` does per model, in one job.
"""

from __future__ import annotations

import os
import sys

import ml_dtypes
import numpy as np

from moe_onnx import InferenceSession
from moe_onnx.ranks import END_OF_RUN, MpiCommunicator


def main(directories: list[str]) -> int:
    communicator = MpiCommunicator(timeout=120)
    rank = communicator.rank
    try:
        for directory in directories:
            session = InferenceSession(
                os.path.join(directory, f"rank{rank}.onnx"), context={"communicator": communicator}
            )
            x = np.load(os.path.join(directory, f"in{rank}.npz"))["x"]
            feed = x.view(ml_dtypes.bfloat16) if x.dtype == np.uint16 else x
            (y,) = session.run(None, {"x": feed})
            np.save(
                os.path.join(directory, f"out{rank}.npy"), y.view(np.uint16) if y.dtype == ml_dtypes.bfloat16 else y
            )
        communicator.allgather(None, END_OF_RUN)  # nobody leaves while a peer may still need it
        return 0
    except BaseException as exc:  # noqa: BLE001 - reported, then the job ends
        print(f"rank {rank}: error: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        communicator.abort(f"rank {rank} failed: {exc}")
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
