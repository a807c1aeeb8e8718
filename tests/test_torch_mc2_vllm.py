"""torch_npu's MC2 names with vLLM-Ascend's MC2 dispatchers' call patterns on each platform
(tests/torch_mc2_vllm_worker.py; v0.11.0: ``global_bs=0`` over batches padded to the largest,
``expert_token_nums_type=0`` into ``group_list_type=0`` grouped matmuls, A2 / A3 arguments,
V1 / V2 names, ``expert_scales`` on the dispatch, the padded tail masked by ``x_active_mask``;
v0.13.0: a capacity ``global_bs``, no mask; v0.9.1: ``global_bs`` = padded batch x W, counts
into ``group_list_type=1``; a capacity ``global_bs`` over unpadded batches; each with and
without a shared expert beside the exchange) equal a dense torch MoE, on 2 gloo ranks (every
case) and 4 (two cases); masked padded rows come back zero, unmasked ones computed. The same
patterns run by vLLM-Ascend's own code: tests/test_vllm_ascend_peers.py (``-m peers``)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.torch_mc2_vllm_worker import CASES, worker
from tests.torch_ranks import start_ranks

TOLERANCE = {"float32": 2e-5, "bfloat16": 4e-2}


def _run(tmp_path, world: int, cases: list) -> list[dict]:
    start_ranks(worker, world, str(tmp_path), cases, directory=str(tmp_path))
    return [dict(np.load(tmp_path / f"rank{r}.npz")) for r in range(world)]


def _relative(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


@pytest.mark.parametrize(
    ("world", "cases"), [(2, list(CASES)), (4, ["a3_v2_masked_expert_scales", "capacity_unpadded_v1"])]
)
def test_dispatcher_call_pattern_equals_a_dense_moe(tmp_path, world, cases):
    saved = _run(tmp_path, world, cases)
    for rank, values in enumerate(saved):
        for case in cases:
            for kind in ("routed", "shared"):
                for dtype, tolerance in TOLERANCE.items():
                    key = f"{case}_{kind}_{dtype}"
                    y, want = values[f"{key}_y"], values[f"{key}_dense"]
                    assert y.shape == want.shape == (5 + rank, 16), (key, y.shape)
                    assert _relative(y, want) <= tolerance, (rank, key, _relative(y, want))
                    # the padded rows (ones): masked by x_active_mask (A3, V2) -> exactly 0, else
                    # computed like any token
                    pad, pad_want = values[f"{key}_pad"], values[f"{key}_pad_dense"]
                    assert pad.shape == ((world - 1 - rank) * CASES[case].padded, 16), (rank, key, pad.shape)
                    if CASES[case].masked:
                        assert not pad.any(), (rank, key)
                    elif len(pad):
                        assert _relative(pad, pad_want) <= tolerance, (rank, key, _relative(pad, pad_want))
