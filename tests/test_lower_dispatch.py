"""The dispatch ops lowered (SPEC 1.11, 1.12, 1.15, 1.16), in a process that never imports
moe_onnx (onnxruntime and onnx.reference), against their kernels over derandomized random cases
(data movement, indices and counts bit-exact; float sums within float32 accumulation error, see
tests/lower_support.py)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_onnx.custom_ops.moe_init_routing import moe_init_routing
from moe_onnx.custom_ops.moe_token_permute import moe_token_permute

from .lower_support import LoweredRunner, check_lowered

OPSETS = (18, 21, 24)
DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
FLOATS = sorted(DTYPES)


@pytest.fixture(scope="module")
def runner():
    worker = LoweredRunner()
    yield worker
    worker.close()


def floats(rng, shape, dtype: str) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32).astype(DTYPES[dtype])


common = dict(
    seed=st.integers(0, 2**32 - 1),
    tokens=st.integers(0, 5),
    top_k=st.integers(1, 3),
    hidden=st.integers(1, 4),
    dtype=st.sampled_from(FLOATS),
    inline=st.booleans(),
    opset=st.sampled_from(OPSETS),
)


@settings(max_examples=25)
@given(**common, one_d=st.booleans(), int64=st.booleans(), cut=st.integers(-3, 3), grad=st.booleans())
def test_permute_and_grad(runner, seed, tokens, top_k, hidden, dtype, inline, opset, one_d, int64, cut, grad):
    rng = np.random.default_rng(seed)
    top_k = 1 if one_d else top_k
    shape = (tokens,) if one_d else (tokens, top_k)
    indices = (rng.integers(0, 4, shape) * (2**40 if int64 else 1)).astype(np.int64 if int64 else np.int32)
    x = floats(rng, (tokens, hidden), dtype)
    n = max(cut, -tokens * top_k) if cut <= 0 else tokens * top_k - cut + 2  # <= 0: all or F + n; > 0: min(n, F)
    if not grad:
        inputs = {"tokens": x, "indices": indices}
        check_lowered(runner, "MoeTokenPermute", inputs, {"num_out_tokens": n}, inline=inline, opset=opset)
        return
    permuted, sorted_indices = moe_token_permute(x, indices, num_out_tokens=n)
    inputs = {"permuted_output_grad": floats(rng, permuted.shape, dtype), "sorted_indices": sorted_indices}
    sums = {"input_grad": ("permuted_output_grad",)}
    check_lowered(runner, "MoeTokenPermuteGrad", inputs, {"num_topk": top_k}, sums=sums, inline=inline, opset=opset)


def unpermute_inputs(rng, tokens, top_k, hidden, dtype, probs_dtype, index_kind, extra_rows):
    top_k = top_k if probs_dtype else 1
    slots = tokens * top_k
    rows = max(slots + extra_rows, 0)
    if index_kind == "permutation":
        index = rng.permutation(slots)
    else:  # repeats and rows past A
        index = rng.integers(0, rows + 2, slots)
    probs = None
    if probs_dtype:
        probs = (rng.random((tokens, top_k)) * (rng.random((tokens, top_k)) < 0.8)).astype(DTYPES[probs_dtype])
    return floats(rng, (rows, hidden), dtype), index.astype(np.int32), probs


unpermute_cases = dict(
    **common,
    probs_dtype=st.sampled_from([None, *FLOATS]),
    index_kind=st.sampled_from(["permutation", "any"]),
    extra_rows=st.integers(-2, 2),
)


@settings(max_examples=25)
@given(**unpermute_cases)
def test_unpermute(runner, seed, tokens, top_k, hidden, dtype, inline, opset, probs_dtype, index_kind, extra_rows):
    rng = np.random.default_rng(seed)
    permuted, index, probs = unpermute_inputs(rng, tokens, top_k, hidden, dtype, probs_dtype, index_kind, extra_rows)
    inputs = {"permuted_tokens": permuted, "sorted_indices": index, "probs": probs}
    sums = {"unpermuted_tokens": ("permuted_tokens", "probs")}
    check_lowered(runner, "MoeTokenUnpermute", inputs, {}, sums=sums, inline=inline, opset=opset)


@settings(max_examples=25)
@given(**unpermute_cases, give_rows=st.booleans(), want_probs_grad=st.booleans())
def test_unpermute_grad(
    runner,
    seed,
    tokens,
    top_k,
    hidden,
    dtype,
    inline,
    opset,
    probs_dtype,
    index_kind,
    extra_rows,
    give_rows,
    want_probs_grad,
):
    rng = np.random.default_rng(seed)
    permuted, index, probs = unpermute_inputs(rng, tokens, top_k, hidden, dtype, probs_dtype, index_kind, extra_rows)
    inputs = {
        "permuted_tokens": permuted if probs is not None or give_rows else None,
        "unpermuted_tokens_grad": floats(rng, (tokens, hidden), dtype),
        "sorted_indices": index,
        "probs": probs,
    }
    attrs = {} if inputs["permuted_tokens"] is not None else {"permuted_tokens_num": len(permuted)}
    outputs = ["permuted_tokens_grad", "probs_grad" if probs is not None and want_probs_grad else ""]
    # a sum of terms bounded by |g| * |probs| (rows) and |g| . |permuted| (probs_grad)
    sums = {
        "permuted_tokens_grad": ("unpermuted_tokens_grad", "probs"),
        "probs_grad": ("unpermuted_tokens_grad", "permuted_tokens"),
    }
    check_lowered(runner, "MoeTokenUnpermuteGrad", inputs, attrs, outputs, sums=sums, inline=inline, opset=opset)


@settings(max_examples=25)
@given(**common, experts=st.integers(1, 5), canonical=st.booleans(), active=st.integers(0, 7), counts=st.booleans())
def test_init_routing_v1_and_expert_tokens(
    runner, seed, tokens, top_k, hidden, dtype, inline, opset, experts, canonical, active, counts
):
    rng = np.random.default_rng(seed)
    expert_idx = rng.integers(0, experts + 1, (tokens, top_k)).astype(np.int32)  # E: omni-infer's sentinel
    if canonical:
        row_idx = np.arange(tokens * top_k, dtype=np.int32).reshape(top_k, tokens).T.copy()
    else:
        row_idx = rng.permutation(tokens * top_k).reshape(tokens, top_k).astype(np.int32)
    x = floats(rng, (tokens, hidden), dtype)
    if not counts:
        inputs = {"x": x, "row_idx": row_idx, "expert_idx": expert_idx}
        check_lowered(runner, "MoeInitRouting", inputs, {"active_num": active}, inline=inline, opset=opset)
        return
    _, _, sorted_experts = moe_init_routing(x, row_idx, expert_idx, active_num=active)
    attrs = {"num_experts": experts}
    check_lowered(
        runner, "MoeComputeExpertTokens", {"sorted_experts": sorted_experts}, attrs, inline=inline, opset=opset
    )
