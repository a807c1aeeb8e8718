"""Done-when of issue 22: expert-parallel chains in omni-infer's style (tests/omni_chain.py,
written with torch_npu's names after install_stand_ins(): softmax top-k gating, v1 init
routing on each side of the all-to-all, expert-token counts, grouped matmul, SwiGLU, finalize
routing with expert ids; and the all-gather chain with sentinel expert ids for the experts that
are not local) on 2 and 4 gloo ranks, float32 and bfloat16, against a dense pure-torch MoE."""

from __future__ import annotations

import numpy as np
import pytest

from tests.moe_chain import Config
from tests.omni_chain import worker
from tests.torch_ranks import start_ranks

#: relative error (max |got - want| / max |want|) against the dense float32 reference
TOLERANCE = {"float32": 2e-5, "bfloat16": 4e-2}
CHAINS = ("alltoall", "allgather_mask", "allgather_tail")


def run(tmp_path, world: int) -> None:
    config = Config(ranks=world)
    start_ranks(worker, world, config, str(tmp_path), directory=str(tmp_path))
    for rank in range(world):
        with np.load(tmp_path / f"errors{rank}.npz") as saved:
            errors = {name: float(saved[name]) for name in saved.files}
        for tokens in config.batches:
            for dtype, tolerance in TOLERANCE.items():
                for chain in CHAINS:
                    assert errors[f"{chain}_{dtype}_{tokens}"] <= tolerance, (rank, chain, dtype, tokens, errors)
                    assert errors[f"{chain}_{dtype}_{tokens}_dtype_ok"] == 1.0
    worst = {
        f"{c}_{d}": max(errors[f"{c}_{d}_{tokens}"] for tokens in config.batches) for c in CHAINS for d in TOLERANCE
    }
    print(f"{world} ranks, worst relative errors (rank {world - 1}): {worst}")


def test_omni_infer_chains_on_2_ranks_match_the_dense_moe(tmp_path):
    run(tmp_path, 2)


@pytest.mark.slow  # 4 processes on CI's cores
def test_omni_infer_chains_on_4_ranks_match_the_dense_moe(tmp_path):
    run(tmp_path, 4)
