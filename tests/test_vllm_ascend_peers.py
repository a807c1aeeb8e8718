"""vLLM-Ascend's unquantised fused-MoE path (v0.11.0: ``select_experts`` and the AllGather and
AllToAll(V) comm methods' ``fused_experts``; v0.9.1: ``fused_experts`` and
``fused_experts_with_all2all``) run unchanged on 2 gloo ranks after ``install_stand_ins()``
(only vLLM's engine stubbed: tests/vllm_ascend.py), float32 and bfloat16, against a dense
pure-torch MoE.

Marked ``peers``: deselected by default; vLLM-Ascend's files are copied at test time from
``$VLLM_ASCEND_<TAG>`` (a checkout) or the release tag of ``$VLLM_ASCEND_GIT`` (a bare clone;
default the workplace's mirror). Without them the test fails saying so (it is never skipped).
"""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.peers

TOLERANCE = {"float32": 2e-5, "bfloat16": 4e-2}
WORLD = 2


@pytest.mark.parametrize("tag", ["v0.11.0", "v0.9.1"])
def test_vllm_ascend_fused_moe_matches_the_dense_moe(tmp_path, tag):
    from tests.cann_recipes import SourceMissing
    from tests.moe_chain import Config
    from tests.torch_ranks import start_ranks
    from tests.vllm_ascend import CASES, copy_release, worker

    source_dir = tmp_path / "vllm_ascend"
    try:
        copy_release(source_dir, tag)
    except SourceMissing as err:
        pytest.fail(f"the peers test needs vLLM-Ascend's files: {err}")
    config = Config(ranks=WORLD)
    start_ranks(worker, WORLD, config, str(source_dir), tag, str(tmp_path), directory=str(tmp_path))
    for rank in range(WORLD):
        failures = (tmp_path / f"failures{rank}.txt").read_text()
        assert not failures, failures
        with np.load(tmp_path / f"errors{rank}.npz") as saved:
            errors = {name: saved[name].item() for name in saved.files}
        for case in CASES[tag]:
            for dtype, tolerance in TOLERANCE.items():
                for tokens in config.batches:
                    assert errors[f"{case}_{dtype}_{tokens}"] <= tolerance, (rank, case, dtype, tokens, errors)
        print(
            f"rank {rank}: worst relative errors",
            {
                k: max(v for n, v in errors.items() if n.startswith(k))
                for k in (f"{c}_{d}" for c in CASES[tag] for d in TOLERANCE)
            },
        )
