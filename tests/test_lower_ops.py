"""Every lowered op, in a process that never imports moe_onnx (onnxruntime and onnx.reference),
against its kernel, over derandomized random cases (see tests/lower_support.py for the
tolerances)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from .lower_support import LoweredRunner, check_lowered

DTYPES = {
    "float32": np.float32,
    "float16": np.float16,
    "bfloat16": ml_dtypes.bfloat16,
    "int8": np.int8,
    "uint8": np.uint8,
    "float8e4m3fn": ml_dtypes.float8_e4m3fn,
    "float8e5m2": ml_dtypes.float8_e5m2,
}


@pytest.fixture(scope="module")
def runner():
    worker = LoweredRunner()
    yield worker
    worker.close()


def random_rows(rng, shape, dtype: str) -> np.ndarray:
    """Random values of ``dtype``; 8-bit types as random bytes: every pattern but the
    float8e5m2 NaNs, whose payloads no runtime keeps (test_float8e5m2_nan_stays_nan)."""
    if dtype in ("int8", "uint8", "float8e4m3fn", "float8e5m2"):
        bits = rng.integers(0, 256, shape, dtype=np.uint8)
        if dtype == "float8e5m2":
            nan = (bits & 0x7F) > 0x7C
            bits[nan] &= 0xFC  # -> +-inf
        return bits.view(DTYPES[dtype])
    return rng.standard_normal(shape).astype(np.float32).astype(DTYPES[dtype])


@settings(max_examples=30)
@given(
    seed=st.integers(0, 2**32 - 1),
    ranks=st.integers(1, 3),
    experts=st.integers(1, 4),
    hidden=st.integers(1, 4),
    dtype=st.sampled_from(sorted(DTYPES)),
    counts_dtype=st.sampled_from(["int32", "int64"]),
    scales=st.sampled_from([None, 1, 2, "uint8x3"]),
    weight=st.booleans(),
    idx_type=st.sampled_from([0, 1]),
    count_type=st.sampled_from([0, 1]),
    inline=st.booleans(),
)
def test_re_routing(
    runner, seed, ranks, experts, hidden, dtype, counts_dtype, scales, weight, idx_type, count_type, inline
):
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, 4, (ranks, experts)).astype(counts_dtype)
    rows = int(counts.sum())
    inputs = {"tokens": random_rows(rng, (rows, hidden), dtype), "expert_token_num_per_rank": counts}
    if scales == "uint8x3":
        inputs["per_token_scales"] = rng.integers(0, 256, (rows, 2, 2), dtype=np.uint8)
    elif scales is not None:
        inputs["per_token_scales"] = rng.standard_normal((rows, 3) if scales == 2 else rows).astype(np.float32)
    else:
        inputs["per_token_scales"] = None
    inputs["expert_topk_weight"] = rng.standard_normal((rows, 1)).astype(np.float32) if weight else None
    attrs = {"idx_type": idx_type, "expert_token_num_type": count_type}
    outputs = (
        None if weight else ["permute_tokens", "permute_per_token_scales", "permute_token_idx", "expert_token_num", ""]
    )
    check_lowered(runner, "MoeReRoutingV2", inputs, attrs, outputs, inline=inline)
