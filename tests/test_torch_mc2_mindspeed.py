"""MindSpeed's mc2 call pattern on our torch_npu names (tests/torch_mc2_mindspeed_worker.py; no
MindSpeed source, so not ``peers``): its two autograd Functions' calls of ``npu_alltoallv_gmm``
/ ``npu_gmm_alltoallv`` (keyword arguments, ``permute_out_flag=True``, W rearranged to a
non-contiguous view in the backward, the lists swapped) and dW by ``npu_grouped_matmul`` over
``[rows.T]`` with a tensor group list, one training step on 2 and 4 gloo ranks against
Megatron-style pure torch (all_to_all_single and per-expert matmuls): values and gradients."""

from __future__ import annotations

import numpy as np
import pytest

from tests.torch_mc2_mindspeed_worker import worker
from tests.torch_ranks import start_ranks

TOLERANCE = {"f32": 2e-5, "bf16": 4e-2}


@pytest.fixture(scope="module", params=[2, 4])
def ranks_run(request, tmp_path_factory):
    out_dir = tmp_path_factory.mktemp(f"mc2_mindspeed_{request.param}")
    start_ranks(worker, request.param, str(out_dir), directory=str(out_dir))
    return [dict(np.load(out_dir / f"rank{r}.npz")) for r in range(request.param)]


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_mindspeed_call_pattern_trains_like_megatron_style_torch(ranks_run, dtype):
    for rank, saved in enumerate(ranks_run):
        assert saved[f"{dtype}_dtypes_ok"], rank
        errors = {k: float(saved[f"{dtype}_{k}"]) for k in ("y", "dx", "dw1", "dw2")}
        assert max(errors.values()) <= TOLERANCE[dtype], (rank, errors)
