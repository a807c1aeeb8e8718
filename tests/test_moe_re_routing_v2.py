"""MoeReRoutingV2 / MoeReRouting: kernel vs the SPEC pseudo-code, session vs kernel, errors."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from hypothesis import given
from hypothesis import strategies as st

import moe_onnx
from moe_onnx.custom_ops import moe_re_routing, moe_re_routing_v2
from tests.support import assert_refused, assert_same_bits, inferred_types, node_model, run_isolated, run_node

TOKEN_DTYPES = [
    np.float32,
    np.float16,
    ml_dtypes.bfloat16,
    np.int8,
    np.uint8,
    ml_dtypes.float8_e4m3fn,
    ml_dtypes.float8_e5m2,
]


def loop_reference(tokens, cnt, scales=None, weight=None, expert_token_num_type=1, idx_type=0):
    """SPEC 1.1 pseudo-code, written as loops and independently of the kernel."""
    N, E = cnt.shape
    A = tokens.shape[0]
    out_tokens = np.zeros_like(tokens)
    out_scales = np.zeros(A, np.float32) if scales is None else np.zeros_like(scales)
    out_weight = None if weight is None else np.zeros_like(weight)
    idx = np.full(A, -1, np.int32)
    src = 0
    for r in range(N):
        for e in range(E):
            n = int(cnt[r, e])
            dst = int(cnt[:, :e].sum()) + int(cnt[:r, e].sum())
            for k in range(n):
                out_tokens[dst + k] = tokens[src + k]
                if scales is not None:
                    out_scales[dst + k] = scales[src + k]
                if weight is not None:
                    out_weight[dst + k] = weight[src + k]
                if idx_type == 0:
                    idx[dst + k] = src + k
                else:
                    idx[src + k] = dst + k
            src += n
    per_expert = cnt.sum(axis=0)
    if expert_token_num_type == 0:
        per_expert = np.cumsum(per_expert)
    return out_tokens, out_scales, idx, per_expert.astype(cnt.dtype), out_weight


def random_bits(rng, shape, dtype):
    """Arbitrary bit patterns (NaN payloads included) of ``dtype``."""
    size = np.dtype(dtype).itemsize
    raw = rng.integers(0, 2 ** (8 * size), size=shape, dtype=np.uint64)
    return raw.astype({1: np.uint8, 2: np.uint16, 4: np.uint32}[size]).view(dtype)


def make_scales(rng, kind, rows):
    if kind == "absent":
        return None
    if kind == "1d":
        return rng.standard_normal(rows).astype(np.float32)
    if kind == "2d":
        return rng.standard_normal((rows, 3)).astype(np.float32)
    return random_bits(rng, (rows, 4, 2), ml_dtypes.float8_e8m0fnu)  # [A, d, 2] float8e8m0


@st.composite
def cases(draw):
    n = draw(st.integers(1, 5))
    e = draw(st.integers(1, 5))
    zero_rate = draw(st.sampled_from([0.0, 0.3, 1.0]))
    seed = draw(st.integers(0, 2**31))
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, 6, (n, e)) * (rng.random((n, e)) >= zero_rate)
    counts = counts.astype(draw(st.sampled_from([np.int32, np.int64])))
    rows = int(counts.sum())
    tokens = random_bits(rng, (rows, draw(st.integers(1, 9))), draw(st.sampled_from(TOKEN_DTYPES)))
    scales = make_scales(rng, draw(st.sampled_from(["absent", "1d", "2d", "3d"])), rows)
    weight = rng.standard_normal((rows, 1)).astype(np.float32) if draw(st.booleans()) else None
    attrs = {"expert_token_num_type": draw(st.sampled_from([0, 1])), "idx_type": draw(st.sampled_from([0, 1]))}
    return tokens, counts, scales, weight, attrs


@given(cases())
def test_kernel_matches_loop_reference(case):
    tokens, counts, scales, weight, attrs = case
    got = moe_re_routing_v2(tokens, counts, scales, weight, **attrs)
    want = loop_reference(tokens, counts, scales, weight, **attrs)
    for g, w in zip(got, want):
        if w is None:
            assert g is None
        else:
            assert_same_bits(g, w)


def session_inputs(tokens, counts, scales, weight):
    return {
        "tokens": tokens,
        "expert_token_num_per_rank": counts,
        "per_token_scales": scales,
        "expert_topk_weight": weight,
    }


def outputs_for(weight):
    return (
        None
        if weight is not None
        else ["permute_tokens", "permute_per_token_scales", "permute_token_idx", "expert_token_num", ""]
    )


@pytest.mark.parametrize("dtype", TOKEN_DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("scales_kind", ["absent", "1d", "2d", "3d"])
def test_session_bit_identical_to_kernel(dtype, scales_kind):
    rng = np.random.default_rng(7)
    counts = rng.integers(0, 5, (3, 4)).astype(np.int64 if scales_kind == "2d" else np.int32)
    counts[1, 2] = 0
    rows = int(counts.sum())
    tokens = random_bits(rng, (rows, 5), dtype)
    scales = make_scales(rng, scales_kind, rows)
    for weight, idx_type, count_type in [(None, 0, 1), (rng.standard_normal((rows, 1)).astype(np.float32), 1, 0)]:
        attrs = {"idx_type": idx_type, "expert_token_num_type": count_type}
        got = run_node("MoeReRoutingV2", session_inputs(tokens, counts, scales, weight), attrs, outputs_for(weight))
        want = [w for w in moe_re_routing_v2(tokens, counts, scales, weight, **attrs) if w is not None]
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert_same_bits(g, w)


@given(cases())
def test_session_matches_kernel_random(case):
    tokens, counts, scales, weight, attrs = case
    got = run_node("MoeReRoutingV2", session_inputs(tokens, counts, scales, weight), attrs, outputs_for(weight))
    want = [w for w in moe_re_routing_v2(tokens, counts, scales, weight, **attrs) if w is not None]
    for g, w in zip(got, want):
        assert_same_bits(g, w)


def test_seed_shape_16_ranks_16_experts_int8():
    """The seed's example shape: 16 x 16 blocks, H = 7168, int8 tokens, float32 scales."""
    rng = np.random.default_rng(3)
    counts = rng.multinomial(16384, np.full(256, 1 / 256)).reshape(16, 16).astype(np.int32)
    tokens = rng.integers(-10, 20, (16384, 7168), dtype=np.int8)
    scales = rng.standard_normal(16384).astype(np.float32)
    want = loop_reference(tokens, counts, scales)
    kernel = moe_re_routing_v2(tokens, counts, scales)
    for k, w in zip(kernel[:4], want[:4]):
        assert_same_bits(k, w)
    got = run_node("MoeReRoutingV2", session_inputs(tokens, counts, scales, None), {}, outputs_for(None))
    for g, k in zip(got, kernel[:4]):
        assert_same_bits(g, k)


def test_seed_example_all_ones():
    """The seed's call: expert_token_num_per_rank = ones(16, 16) so A = 256."""
    counts = np.ones((16, 16), np.int32)
    tokens = np.arange(256 * 4, dtype=np.int8).reshape(256, 4)
    out_tokens, _, idx, per_expert, _ = moe_re_routing_v2(tokens, counts)
    # row r*16 + e moves to e*16 + r: a transpose of the (rank, expert) grid
    assert np.array_equal(idx, np.arange(256).reshape(16, 16).T.ravel())
    assert np.array_equal(out_tokens, tokens[idx])
    assert np.array_equal(per_expert, np.full(16, 16))


def test_zero_rows():
    counts = np.zeros((2, 3), np.int64)
    tokens = np.zeros((0, 4), ml_dtypes.bfloat16)
    weight = np.zeros((0, 1), np.float32)
    got = run_node("MoeReRoutingV2", session_inputs(tokens, counts, None, weight))
    assert [g.shape for g in got] == [(0, 4), (0,), (0,), (3,), (0, 1)]
    assert np.array_equal(got[3], np.zeros(3, np.int64))


def test_moe_re_routing_without_weight():
    rng = np.random.default_rng(1)
    counts = rng.integers(0, 4, (4, 2)).astype(np.int32)
    tokens = rng.standard_normal((int(counts.sum()), 3)).astype(np.float16)
    got = run_node(
        "MoeReRouting",
        {"tokens": tokens, "expert_token_num_per_rank": counts, "per_token_scales": None},
        {"idx_type": 1},
    )
    want = moe_re_routing(tokens, counts, idx_type=1)
    assert len(got) == 4
    for g, w in zip(got, want):
        assert_same_bits(g, w)


def test_plain_onnxruntime_session_with_prepared_model():
    """prepare_for_ort + session_options: a stock onnxruntime session runs the model."""
    rng = np.random.default_rng(2)
    counts = rng.integers(0, 4, (3, 3)).astype(np.int32)
    tokens = rng.standard_normal((int(counts.sum()), 6)).astype(ml_dtypes.bfloat16)
    weight = rng.standard_normal((int(counts.sum()), 1)).astype(np.float32)
    model = node_model("MoeReRoutingV2", session_inputs(tokens, counts, None, weight))
    before = model.SerializeToString()
    prepared = moe_onnx.prepare_for_ort(model)
    assert model.SerializeToString() == before
    session = ort.InferenceSession(
        prepared.SerializeToString(), moe_onnx.session_options(), providers=["CPUExecutionProvider"]
    )
    feeds = {
        "tokens": ort.OrtValue.ortvalue_from_numpy_with_onnx_type(tokens.view(np.uint16), onnx.TensorProto.BFLOAT16),
        "expert_token_num_per_rank": ort.OrtValue.ortvalue_from_numpy(counts),
        "expert_topk_weight": ort.OrtValue.ortvalue_from_numpy(weight),
    }
    got = session.run_with_ort_values(None, feeds)
    want = moe_re_routing_v2(tokens, counts, None, weight)
    assert got[0].data_type() == "tensor(bfloat16)"
    for g, w in zip(got[1:], want[1:]):
        assert np.array_equal(g.numpy(), w)


def test_user_model_untouched(tmp_path):
    counts = np.ones((2, 2), np.int32)
    tokens = np.ones((4, 2), np.float32)
    model = node_model("MoeReRoutingV2", session_inputs(tokens, counts, None, None), outputs=outputs_for(None))
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    before = path.read_bytes()
    in_memory = model.SerializeToString()
    moe_onnx.InferenceSession(str(path)).run(None, {"tokens": tokens, "expert_token_num_per_rank": counts})
    moe_onnx.InferenceSession(model).run(None, {"tokens": tokens, "expert_token_num_per_rank": counts})
    assert path.read_bytes() == before
    assert model.SerializeToString() == in_memory


@pytest.mark.parametrize("executor", moe_onnx.runtime.session.KERNEL_EXECUTORS)
def test_deterministic_bits(executor):
    rng = np.random.default_rng(5)
    counts = rng.integers(0, 30, (8, 8)).astype(np.int32)
    tokens = random_bits(rng, (int(counts.sum()), 64), ml_dtypes.bfloat16)
    model = node_model("MoeReRoutingV2", session_inputs(tokens, counts, None, None), outputs=outputs_for(None))
    session = moe_onnx.InferenceSession(model, executor=executor)
    feeds = {"tokens": tokens, "expert_token_num_per_rank": counts}
    first = session.run(None, feeds)
    for _ in range(3):
        for a, b in zip(first, session.run(None, feeds)):
            assert_same_bits(a, b)


@pytest.mark.parametrize("executor", moe_onnx.runtime.session.KERNEL_EXECUTORS)
def test_error_does_not_poison_the_next_run(executor):
    counts = np.array([[1, 1]], np.int32)
    tokens = np.ones((2, 3), np.float32)
    model = node_model("MoeReRoutingV2", session_inputs(tokens, counts, None, None), outputs=outputs_for(None))
    session = moe_onnx.InferenceSession(model, executor=executor)
    with pytest.raises(moe_onnx.MoeOpError, match="must equal A"):
        session.run(None, {"tokens": tokens, "expert_token_num_per_rank": counts * 2})
    got = session.run(None, {"tokens": tokens, "expert_token_num_per_rank": counts})
    assert np.array_equal(got[0], tokens)


# --- errors: refused by the bare call and both executors -------------------------------

counts = np.array([[2, 1], [0, 3]], np.int32)
tokens = np.ones((6, 4), np.float32)
weight = np.ones((6, 1), np.float32)


def run(tokens=tokens, counts=counts, scales=None, weight=None, outputs=None, **attrs):
    inputs = {
        "tokens": tokens,
        "expert_token_num_per_rank": counts,
        "per_token_scales": scales,
        "expert_topk_weight": weight,
    }
    if outputs is None and weight is None:
        outputs = ["permute_tokens", "permute_per_token_scales", "permute_token_idx", "expert_token_num", ""]
    return run_node("MoeReRoutingV2", inputs, attrs, outputs)


def test_error_counts_do_not_sum_to_rows():
    assert_refused(lambda: run(counts=counts + 1), 561002, "must equal A", "node 'node'", "got 10")


def test_error_negative_counts():
    assert_refused(lambda: run(counts=np.array([[3, -1], [1, 3]], np.int32)), 561002, "must be >= 0", "[0, 1]")


def test_error_wrong_rank_tokens():
    assert_refused(lambda: run(tokens=np.ones(6, np.float32)), 561002, "'tokens' must have rank 2")


def test_error_wrong_rank_counts():
    assert_refused(lambda: run(counts=counts.reshape(1, 2, 2)), 561002, "'expert_token_num_per_rank' must have rank 2")


def test_error_weight_without_output():
    assert_refused(lambda: run(weight=weight, outputs=["a", "b", "c", "d", ""]), 561002, "must be given together")


def test_error_output_without_weight():
    assert_refused(lambda: run(outputs=["a", "b", "c", "d", "e"]), 561002, "must be given together")


def test_error_bad_idx_type():
    assert_refused(lambda: run(idx_type=2), 561002, "'idx_type' must be one of [0, 1]")


def test_error_bad_token_dtype():
    assert_refused(lambda: run(tokens=np.ones((6, 4), np.float64)), 161002, "float64")


def test_error_weight_shape():
    assert_refused(lambda: run(weight=np.ones((6, 2), np.float32)), 561002, "[A, 1]")


def test_error_scales_rows():
    assert_refused(lambda: run(scales=np.ones(5, np.float32)), 561002, "per_token_scales dim 0")


def test_bare_kernel_call_raises_too():
    with pytest.raises(moe_onnx.MoeOpError) as info:
        moe_onnx.OPS["MoeReRoutingV2"](np.ones((3, 2), np.int8), np.array([[1, 1]], np.int32))
    assert info.value.code == 561002 and info.value.op_type == "MoeReRoutingV2"


# --- shape inference ------------------------------------------------------------------


def test_shape_inference_symbolic_rows_and_absent_inputs():
    tokens = np.ones((6, 4), ml_dtypes.bfloat16)
    counts = np.ones((2, 3), np.int64)
    model = node_model(
        "MoeReRoutingV2", session_inputs(tokens, counts, None, None), outputs=outputs_for(None), symbolic=True
    )
    del model.graph.output[:]
    out = inferred_types(model)
    bf16, f32, i32, i64 = (
        onnx.TensorProto.BFLOAT16,
        onnx.TensorProto.FLOAT,
        onnx.TensorProto.INT32,
        onnx.TensorProto.INT64,
    )
    assert out["permute_tokens"] == (bf16, ["tokens_0", "tokens_1"])
    assert out["permute_per_token_scales"] == (f32, ["tokens_0"])
    assert out["permute_token_idx"] == (i32, ["tokens_0"])
    assert out["expert_token_num"] == (i64, ["expert_token_num_per_rank_1"])


def test_shape_inference_with_scales_and_weight():
    scales = np.ones((6, 2, 2), ml_dtypes.float8_e8m0fnu)
    model = node_model(
        "MoeReRoutingV2",
        session_inputs(np.ones((6, 4), np.int8), np.ones((2, 3), np.int32), scales, np.ones((6, 1), np.float32)),
        symbolic=True,
    )
    del model.graph.output[:]
    out = inferred_types(model)
    assert out["permute_per_token_scales"] == (
        onnx.TensorProto.FLOAT8E8M0,
        ["per_token_scales_0", "per_token_scales_1", "per_token_scales_2"],
    )
    assert out["permute_topk_weight"] == (onnx.TensorProto.FLOAT, ["expert_topk_weight_0", "expert_topk_weight_1"])
    assert out["expert_token_num"][0] == onnx.TensorProto.INT32


def test_shape_inference_rejects_mismatched_rows():
    model = node_model(
        "MoeReRoutingV2",
        session_inputs(np.ones((6, 4), np.int8), np.ones((2, 3), np.int32), None, None),
        outputs=outputs_for(None),
    )
    model.graph.input.append(onnx.helper.make_tensor_value_info("per_token_scales", onnx.TensorProto.FLOAT, [5]))
    model.graph.node[0].input.append("per_token_scales")
    with pytest.raises(Exception, match="per_token_scales dim 0 must equal A"):
        onnx.shape_inference.infer_shapes(model, strict_mode=True)


def test_checker_accepts_model():
    model = node_model(
        "MoeReRoutingV2",
        session_inputs(np.ones((6, 4), np.int8), np.ones((2, 3), np.int32), None, np.ones((6, 1), np.float32)),
    )
    onnx.checker.check_model(model, full_check=True)


def test_plain_onnxruntime_session_logs_refused_input_and_survives():
    """With a stock session nobody can re-raise: the error is logged, outputs are empty."""
    result = run_isolated("""
import numpy as np, onnxruntime as ort, moe_onnx
from moe_onnx import single_node_model as node_model
counts = np.array([[2, 1]], np.int32); tokens = np.ones((3, 4), np.float32)
model = node_model("MoeReRoutingV2", {"tokens": tokens, "expert_token_num_per_rank": counts},
                   outputs=["a", "b", "c", "d", ""])
prepared = moe_onnx.prepare_for_ort(model)
session = ort.InferenceSession(prepared.SerializeToString(), moe_onnx.session_options(),
                               providers=["CPUExecutionProvider"])
out = session.run(None, {"tokens": tokens, "expert_token_num_per_rank": counts * 2})
print("SHAPE", out[0].shape)
out = session.run(None, {"tokens": tokens, "expert_token_num_per_rank": counts})
print("OK", bool((out[0] == tokens).all()))
""")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "SHAPE (0, 0)" in result.stdout and "OK True" in result.stdout
    assert "expert_token_num_per_rank[0, 0] = 4 exceeds A = tokens.shape[0] = 3" in result.stderr
