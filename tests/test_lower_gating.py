"""The gating ops lowered to standard ONNX, in a process that never imports moe_onnx
(onnxruntime and onnx.reference), against their kernels: bit for bit. The bodies compute the
scores and weights in double and cast once, as the kernels do; TopK's ties go to the lower
index as the kernels' rankings do (tie-heavy grids included)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import moe_onnx
from moe_onnx.custom_ops import OPS
from moe_onnx.custom_ops.moe_gating_top_k import moe_gating_top_k

from .lower_support import LoweredRunner, check_lowered
from .support import node_model

OPSETS = (18, 21, 24)
DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


@pytest.fixture(scope="module")
def runner():
    worker = LoweredRunner()
    yield worker
    worker.close()


def logits(rng, shape, dtype: str, tied: bool) -> np.ndarray:
    values = rng.integers(-6, 7, shape) / 4 if tied else rng.standard_normal(shape)
    return values.astype(np.float32).astype(DTYPES[dtype])


@settings(max_examples=30)
@given(
    seed=st.integers(0, 2**32 - 1),
    lead=st.sampled_from([(0,), (1,), (5,), (2, 3), (1, 0)]),
    experts=st.integers(1, 9),
    dtype=st.sampled_from(sorted(DTYPES)),
    tied=st.booleans(),
    finished=st.booleans(),
    inline=st.booleans(),
    opset=st.sampled_from(OPSETS),
)
def test_softmax(runner, seed, lead, experts, dtype, tied, finished, inline, opset):
    rng = np.random.default_rng(seed)
    inputs = {
        "x": logits(rng, lead + (experts,), dtype, tied),
        "finished": rng.random(lead) < 0.4 if finished else None,
    }
    k = int(rng.integers(1, experts + 1))
    check_lowered(runner, "MoeGatingTopKSoftmax", inputs, {"k": k}, inline=inline, opset=opset)


@st.composite
def top_k_cases(draw):
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    mode = draw(st.sampled_from([0, 1]))
    groups, per = draw(st.integers(1, 4)), draw(st.integers(mode + 1, 5))
    experts = groups * per
    k_group = draw(st.integers(1, groups))
    k = draw(st.integers(1, k_group * per))
    tokens = draw(st.integers(0, 5))
    dtype = draw(st.sampled_from(sorted(DTYPES)))
    tied = draw(st.booleans())
    inputs = {
        "x": logits(rng, (tokens, experts), dtype, tied),
        "bias": logits(rng, experts, dtype, tied) / 8 if draw(st.booleans()) else None,
        "input_ids": None,
        "tid2eid": None,
    }
    if draw(st.booleans()):  # hash mode
        rows = draw(st.integers(1, 4))
        inputs["input_ids"] = rng.integers(0, rows, tokens).astype(draw(st.sampled_from([np.int32, np.int64])))
        inputs["tid2eid"] = rng.integers(0, experts, (rows, k)).astype(draw(st.sampled_from([np.int32, np.int64])))
    attrs = {
        "k": k,
        "k_group": k_group,
        "group_count": groups,
        "group_select_mode": mode,
        "renorm": draw(st.sampled_from([0, 1])),
        "norm_type": draw(st.sampled_from([0, 1, 2])),
        "routed_scaling_factor": draw(st.sampled_from([1.0, 2.5])),
        "eps": draw(st.sampled_from([1e-20, 0.25])),
    }
    return inputs, attrs


@settings(max_examples=40)
@given(case=top_k_cases(), inline=st.booleans(), opset=st.sampled_from(OPSETS))
def test_top_k(runner, case, inline, opset):
    inputs, attrs = case
    check_lowered(runner, "MoeGatingTopK", inputs, attrs, inline=inline, opset=opset)


@settings(max_examples=30)
@given(case=top_k_cases(), inline=st.booleans(), opset=st.sampled_from(OPSETS))
def test_backward(runner, case, inline, opset):
    inputs, attrs = case
    attrs = {**attrs, "norm_type": 1}
    _, expert_idx, out = moe_gating_top_k(*inputs.values(), **attrs)
    rng = np.random.default_rng(len(out))
    grad_y = rng.standard_normal(expert_idx.shape).astype(inputs["x"].dtype)
    backward_attrs = {a: attrs[a] for a in ("renorm", "routed_scaling_factor", "eps")}
    grad_inputs = {"x_norm": out, "grad_y": grad_y, "expert_idx": expert_idx}
    check_lowered(runner, "MoeGatingTopKBackward", grad_inputs, backward_attrs, inline=inline, opset=opset)


def check_non_finite(runner, op_type, inputs, attrs):
    """As check_lowered, but a computed NaN may carry another sign or payload in each runtime."""
    model = node_model(op_type, inputs, attrs)
    want = OPS[op_type](*inputs.values(), **attrs)
    reply = runner.run(moe_onnx.lower(model), {k: v for k, v in inputs.items() if v is not None})
    for runtime in ("onnxruntime", "reference"):
        for got, expected in zip(reply[runtime], want):
            assert got.dtype == expected.dtype
            np.testing.assert_array_equal(got, expected, err_msg=f"{runtime}, {op_type}, {attrs}")


def test_non_finite_logits(runner):
    """NaN and infinities: the same NaN rows and -inf rankings as the kernels."""
    x = np.array([[0, np.nan, 1, 2], [np.inf, 0, 1, 2], [-np.inf] * 4, [-np.inf, 0, -np.inf, 1]], np.float32)
    check_non_finite(runner, "MoeGatingTopKSoftmax", {"x": x, "finished": None}, {"k": 2})
    bias = np.array([0, np.nan, -np.inf, np.inf], np.float32)
    for norm_type in (0, 1, 2):
        attrs = {"k": 2, "k_group": 1, "group_count": 2, "group_select_mode": 1, "norm_type": norm_type}
        check_non_finite(runner, "MoeGatingTopK", {"x": x, "bias": bias}, attrs)


def test_deepseek_v3_shape(runner):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((256, 256)).astype(ml_dtypes.bfloat16)
    bias = (rng.standard_normal(256) * 0.01).astype(ml_dtypes.bfloat16)
    attrs = {
        "k": 8,
        "k_group": 4,
        "group_count": 8,
        "group_select_mode": 1,
        "norm_type": 1,
        "routed_scaling_factor": 2.5,
    }
    for inline in (False, True):
        check_lowered(runner, "MoeGatingTopK", {"x": x, "bias": bias}, attrs, inline=inline)


@pytest.mark.parametrize("inline", [False, True])
def test_sqrt_softplus_overflows_to_inf_like_the_kernel(runner, inline):
    """SPEC-layer 1.14 (b) amended: above 88.72283 the NPU's float32 Exp overflows and the score is inf."""
    limit = np.float32(88.72283)
    x = np.array([[limit, np.nextafter(limit, np.float32(100)), 1.0, 200.0, -3.0, 90.0]], np.float32)
    check_lowered(runner, "MoeGatingTopK", {"x": x}, {"k": 4, "norm_type": 2, "out_flag": 1}, inline=inline)


@pytest.mark.parametrize("experts, k", [(12, 2), (16, 9), (16, 8)])
def test_float16_softmax_ranking_follows_the_npu_template(runner, experts, k):
    """SPEC-layer 1.13 (b) amended: the body ranks float16 probabilities where the kernel does."""
    x = np.full((3, experts), -8.0, np.float16)
    x[:, 0], x[:, 1] = np.float16(0.0), np.float16(2**-14)
    x[2, 3] = np.float16(np.nan)
    check_lowered(runner, "MoeGatingTopKSoftmax", {"x": x}, {"k": k})
