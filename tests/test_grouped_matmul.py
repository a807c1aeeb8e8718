"""GroupedMatmul (SPEC-layer 1.9): the kernel against float64 loops of the SPEC formulas for
the three group types, transposed storage, the two backward products against the VJP of the
forward kernel, sessions bit-identical with the kernel, bits that do not depend on threads,
errors and shape inference."""

from __future__ import annotations

import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper

import moe_onnx
from moe_onnx.custom_ops import TensorInfo, parallel, targets
from moe_onnx.custom_ops.grouped_matmul import grouped_matmul
from tests.support import assert_refused, assert_same_bits, inferred_types, run_node

FLOAT_DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16]
EPS32 = float(np.finfo(np.float32).eps)


def offsets_of(group_list: np.ndarray, group_list_type: int) -> list[int]:
    counts = group_list if group_list_type == 1 else np.diff(np.concatenate([[0], group_list]))
    return [0] + np.cumsum(counts).tolist()


def reference(x, weight, bias, group_list, group_type, group_list_type=0, transpose_weight=0, transpose_x=0):
    """SPEC-layer 1.9 (b) as float64 loops over groups and rows."""
    a = (x.T if transpose_x else x).astype(np.float64)
    w = (np.swapaxes(weight, -1, -2) if transpose_weight else weight).astype(np.float64)
    b = None if bias is None else bias.astype(np.float64)
    if group_type == -1:
        return a @ w + (0 if b is None else b)
    off = offsets_of(group_list, group_list_type)
    if group_type == 0:
        y = np.zeros((a.shape[0], w.shape[-1]))
        for e in range(len(off) - 1):
            for m in range(off[e], off[e + 1]):
                y[m] = a[m] @ w[e] + (0 if b is None else b[e])
        return y
    y = np.zeros((len(off) - 1, a.shape[0], w.shape[-1]))
    for e in range(len(off) - 1):
        y[e] = a[:, off[e] : off[e + 1]] @ w[off[e] : off[e + 1]]
    return y


def assert_product_close(got, want, bound):
    """float32 accumulation (K terms): |got - want| <= K eps32 * sum|terms| + half an ulp."""
    eps = float(ml_dtypes.finfo(got.dtype).eps)
    error = np.abs(got.astype(np.float64) - want)
    allowed = 4 * EPS32 * bound + 0.5 * eps * np.abs(want) + float(ml_dtypes.finfo(got.dtype).smallest_normal)
    assert (error <= allowed).all(), float((error - allowed).max())


@st.composite
def cases(draw):
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    group_type = draw(st.sampled_from([0, 2, -1]))
    experts, rows, inner, columns = (draw(st.integers(1, 5)) for _ in range(4))
    rows = draw(st.integers(0, 9))
    dtype = draw(st.sampled_from(FLOAT_DTYPES))
    list_type = draw(st.sampled_from([0, 1]))
    grouped = rows if group_type == 0 else inner * experts if group_type == 2 else 0
    counts = rng.multinomial(draw(st.integers(0, grouped)), np.ones(experts) / experts) if group_type != -1 else None
    group_list = None if counts is None else (counts if list_type else np.cumsum(counts)).astype(np.int64)
    if group_type == 0:
        x, w = rng.standard_normal((rows, inner)), rng.standard_normal((experts, inner, columns))
        bias = rng.standard_normal((experts, columns)) if draw(st.booleans()) else None
    elif group_type == 2:
        x, w, bias = rng.standard_normal((rows, grouped)), rng.standard_normal((grouped, columns)), None
    else:
        x, w = rng.standard_normal((rows, inner)), rng.standard_normal((inner, columns))
        bias = rng.standard_normal(columns) if draw(st.booleans()) else None
        group_list = None
    attrs = {"group_type": group_type}
    if group_list is not None:
        attrs["group_list_type"] = list_type
    x, w = x.astype(dtype), w.astype(dtype)
    if draw(st.booleans()):
        w = np.ascontiguousarray(np.swapaxes(w, -1, -2))
        attrs["transpose_weight"] = 1
    if draw(st.booleans()):
        x = np.ascontiguousarray(x.T)
        attrs["transpose_x"] = 1
    if bias is not None:
        bias = bias.astype(np.float16 if dtype == np.float16 else np.float32)
    return {"x": x, "weight": w, "bias": bias, "group_list": group_list}, attrs


@given(cases())
def test_kernel_matches_the_loops(case):
    inputs, attrs = case
    (y,) = grouped_matmul(*inputs.values(), **attrs)
    want = reference(*inputs.values(), **attrs)
    absolute = {k: None if v is None else np.abs(v.astype(np.float64)) for k, v in inputs.items()}
    bound = reference(absolute["x"], absolute["weight"], absolute["bias"], inputs["group_list"], **attrs)
    assert y.dtype == inputs["x"].dtype
    assert_product_close(y, want, bound * inputs["x"].shape[1 - attrs.get("transpose_x", 0)])


@settings(max_examples=25)  # two sessions per example
@given(cases())
def test_session_equals_the_kernel(case):
    inputs, attrs = case
    (y,) = run_node("GroupedMatmul", inputs, attrs)
    assert_same_bits(y, grouped_matmul(*inputs.values(), **attrs)[0])


def test_rows_past_the_groups_are_zero_and_empty_groups_allowed():
    x = np.arange(12, dtype=np.float32).reshape(6, 2)
    w = np.stack([np.eye(2, dtype=np.float32), 2 * np.eye(2, dtype=np.float32), 3 * np.eye(2, dtype=np.float32)])
    (y,) = run_node(
        "GroupedMatmul",
        {"x": x, "weight": w, "group_list": np.array([2, 0, 1], np.int64)},
        {"group_type": 0, "group_list_type": 1},
    )
    np.testing.assert_array_equal(y, np.concatenate([x[:2], 3 * x[2:3], np.zeros((3, 2), np.float32)]))
    (k,) = run_node(
        "GroupedMatmul", {"x": x.T.copy(), "weight": x, "group_list": np.array([3, 3], np.int64)}, {"group_type": 2}
    )
    np.testing.assert_array_equal(k, np.stack([x[:3].T @ x[:3], np.zeros((2, 2), np.float32)]))


def forward_jacobian(function, size: int) -> np.ndarray:
    """[out.size, size] of a linear function of a flat float64 vector (one unit vector per column)."""
    return np.stack([function(np.eye(size)[k]).ravel() for k in range(size)], axis=1)


@pytest.mark.parametrize("transpose_weight", [0, 1])
@pytest.mark.parametrize("list_type", [0, 1])
def test_backward_products_are_the_vjp_of_the_forward_float64(transpose_weight, list_type):
    """MindSpeed's backward: dx = GMM(dy, W, transpose toggled), dW = GMM(x, dy, split K,
    transpose_x): both J^T dy of the forward kernel, float64 bare kernels."""
    rng = np.random.default_rng(2 + transpose_weight + 2 * list_type)
    rows, inner, columns = 7, 3, 4
    counts = np.array([2, 0, 4])  # one row past the groups: it gets no gradient
    group_list = (counts if list_type else np.cumsum(counts)).astype(np.int64)
    attrs = {"group_type": 0, "group_list_type": list_type, "transpose_weight": transpose_weight}
    x = rng.standard_normal((rows, inner))
    stored = (3, columns, inner) if transpose_weight else (3, inner, columns)
    w = rng.standard_normal(stored)
    dy = rng.standard_normal((rows, columns))

    def forward_in_x(flat):
        return grouped_matmul(flat.reshape(rows, inner), w, None, group_list, **attrs)[0]

    def forward_in_w(flat):
        return grouped_matmul(x, flat.reshape(stored), None, group_list, **attrs)[0]

    vjp_x = (forward_jacobian(forward_in_x, x.size).T @ dy.ravel()).reshape(x.shape)
    vjp_w = (forward_jacobian(forward_in_w, w.size).T @ dy.ravel()).reshape(stored)
    grouped = {"group_list_type": list_type}
    (dx,) = grouped_matmul(dy, w, None, group_list, group_type=0, transpose_weight=1 - transpose_weight, **grouped)
    if transpose_weight:
        (dw,) = grouped_matmul(dy, x, None, group_list, group_type=2, transpose_x=1, **grouped)
    else:
        (dw,) = grouped_matmul(x, dy, None, group_list, group_type=2, transpose_x=1, **grouped)
    np.testing.assert_allclose(dx, vjp_x, rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(dw, vjp_w, rtol=1e-13, atol=1e-13)


_BITS_PROGRAM = """
import hashlib, sys
import numpy as np, ml_dtypes
from moe_onnx.custom_ops import parallel
from moe_onnx.custom_ops.grouped_matmul import grouped_matmul
parallel._MAX_WORKERS = int(sys.argv[1])
rng = np.random.default_rng(0)
digest = hashlib.sha1()
for dtype in (np.float32, ml_dtypes.bfloat16):
    x = rng.standard_normal((1500, 384)).astype(dtype)
    w = rng.standard_normal((5, 384, 640)).astype(dtype)
    group_list = np.array([100, 700, 700, 1300, 1500], np.int64)
    for y in (grouped_matmul(x, w, None, group_list, group_type=0)[0],
              grouped_matmul(x, x, None, np.array([500, 1500], np.int64), group_type=2, transpose_x=1)[0]):
        digest.update(y.tobytes())
print(digest.hexdigest())
"""


def test_bits_do_not_depend_on_blas_or_kernel_threads():
    """OpenBLAS gives other float32 bits on 1 thread than on 2 (measured); the kernel's blocks
    run single-threaded BLAS, so neither OPENBLAS_NUM_THREADS nor the kernel's own thread count
    changes them."""
    digests = set()
    for blas_threads, kernel_threads in (("1", "1"), ("2", "4")):
        env = {"OPENBLAS_NUM_THREADS": blas_threads, "PATH": "/usr/bin:/bin"}
        result = subprocess.run(
            [sys.executable, "-c", _BITS_PROGRAM, kernel_threads], capture_output=True, text=True, env=env, timeout=300
        )
        assert result.returncode == 0, result.stderr
        digests.add(result.stdout.strip())
    assert len(digests) == 1, digests


def test_blas_blocks_are_handed_out_biggest_first_each_weight_widened_once(monkeypatch):
    """The BLAS blocks go to the threads as they come free, the biggest share first (a share
    is one block, or for a weight that must be widened, an expert's consecutive blocks: each
    weight is widened once)."""
    import importlib

    module = importlib.import_module("moe_onnx.custom_ops.grouped_matmul")
    blocks = [
        (None, np.ones((rows, 8), np.float32), np.ones((8, 4), np.float32), None, key)
        for rows, key in ((100, 0), (512, 1), (300, 1), (200, 2), (200, 3))
    ]
    alone = module._shares(blocks, widened=False)
    assert [[b[1].shape[0] for b in share] for share in alone] == [[512], [300], [200], [200], [100]]
    assert [share[0][4] for share in alone][2:4] == [2, 3]  # ties keep the blocks' order
    grouped = module._shares(blocks, widened=True)
    assert [[b[1].shape[0] for b in share] for share in grouped] == [[512, 300], [200], [200], [100]]

    weight_shape = (40, 24)
    widened = []
    real_widen = module._bfloat16_bits_widened

    def counting(array):
        if array.shape[::-1] == weight_shape or array.shape == weight_shape:
            widened.append(array.shape)
        return real_widen(array)

    monkeypatch.setattr(module, "_bfloat16_bits_widened", counting)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((1500, 40)).astype(ml_dtypes.bfloat16)
    w = rng.standard_normal((3, *weight_shape)).astype(ml_dtypes.bfloat16)
    y = grouped_matmul(x, w, None, np.array([100, 1300, 100], np.int64), group_type=0, group_list_type=1)[0]
    assert len(widened) == 3  # expert 1's 1300 rows are three blocks, one widening
    wide = x.astype(np.float32)
    expected = np.concatenate(
        [
            wide[:100] @ w[0].astype(np.float32),
            wide[100:1400] @ w[1].astype(np.float32),
            wide[1400:] @ w[2].astype(np.float32),
        ]
    )
    np.testing.assert_allclose(y.astype(np.float32), expected, rtol=2e-2, atol=2e-2)


def test_blas_thread_limit_is_given_back():
    import threadpoolctl

    before = [info["num_threads"] for info in threadpoolctl.threadpool_info() if info["user_api"] == "blas"]
    x = np.ones((600, 64), np.float32)
    grouped_matmul(x, np.ones((1, 64, 64), np.float32), None, np.array([600], np.int64), group_type=0)
    after = [info["num_threads"] for info in threadpoolctl.threadpool_info() if info["user_api"] == "blas"]
    assert before == after
    assert parallel.workers() >= 1


# --- errors ------------------------------------------------------------------------------

X = np.ones((6, 3), np.float32)
W = np.ones((2, 3, 4), np.float32)
GROUPS = np.array([2, 6], np.int64)


def run(inputs=None, **attrs):
    given_inputs = {"x": X, "weight": W, "bias": None, "group_list": GROUPS}
    given_inputs.update(inputs or {})
    return run_node("GroupedMatmul", given_inputs, {"group_type": 0, **attrs})


@pytest.mark.parametrize(
    "inputs, attrs, code, fragment",
    [
        ({}, {"group_type": 1}, 561002, "group_type 1 (split N)"),
        ({}, {"group_type": 3}, 561002, "group_type must be -1, 0 or 2"),
        ({}, {"group_list_type": 2}, 161002, "group_list_type 2"),
        ({}, {"split_item": 0}, 561002, "split_item 0 asks for one output per group"),
        ({}, {"split_item": 5}, 561002, "split_item must be in 0..3"),
        ({}, {"output_dtype": TensorProto.FLOAT16}, 161002, "output_dtype 10 (float16) is not supported"),
        ({"weight": W.astype(np.float16)}, {}, 161002, "weight must have x's dtype (float32)"),
        ({"weight": np.ones((2, 5, 4), np.float32)}, {}, 561002, "inner (K) dims of x and weight must agree"),
        ({"group_list": np.array([6], np.int64)}, {}, 561002, "len(group_list) must equal E"),
        ({"group_list": None}, {}, 161001, "group_type 0 needs group_list"),
        ({"group_list": np.array([4, 2], np.int64)}, {}, 561002, "must not decrease"),
        ({"group_list": np.array([3, 7], np.int64)}, {}, 561002, "the groups cover 7 rows of x"),
        # a decrease whose difference wraps around in int64 (the kernel looped for ever on it)
        ({"group_list": np.array([2**62, -(2**63)], np.int64)}, {}, 561002, "must not decrease"),
        ({"group_list": np.array([3, -1], np.int64)}, {"group_list_type": 1}, 561002, "got -1 at 1"),
        ({"bias": np.ones((2, 4), np.float16)}, {}, 161002, "bias must be float32 with float32 x"),
        ({"bias": np.ones((3, 4), np.float32)}, {}, 561002, "bias must be [E, N]: dim 0"),
        ({"weight": np.ones((3, 4), np.float32)}, {}, 561002, "weight must be [E, K, N] for group_type 0"),
    ],
)
def test_errors(inputs, attrs, code, fragment):
    assert_refused(lambda: run(inputs, **attrs), code, fragment)


def test_errors_of_the_other_group_types():
    assert_refused(
        lambda: run({"weight": np.ones((3, 4), np.float32)}, group_type=-1), 561002, "group_type -1 takes no group_list"
    )
    x, dy = np.ones((6, 3), np.float32), np.ones((6, 4), np.float32)
    assert_refused(
        lambda: run_node(
            "GroupedMatmul",
            {"x": x, "weight": dy, "bias": np.ones(4, np.float32), "group_list": GROUPS},
            {"group_type": 2, "transpose_x": 1},
        ),
        561002,
        "group_type 2 (split K) takes no bias",
    )


def test_shape_inference_keeps_symbols():
    nodes = [
        helper.make_node("GroupedMatmul", ["x", "w", "", "g"], ["y"], domain=moe_onnx.DOMAIN, group_type=0),
        helper.make_node(
            "GroupedMatmul", ["x", "dy", "", "g"], ["dw"], domain=moe_onnx.DOMAIN, group_type=2, transpose_x=1
        ),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.BFLOAT16, ["M", 64]),
            helper.make_tensor_value_info("w", TensorProto.BFLOAT16, ["E", 64, 96]),
            helper.make_tensor_value_info("dy", TensorProto.BFLOAT16, ["M", 96]),
            helper.make_tensor_value_info("g", TensorProto.INT64, ["E"]),
        ],
        [],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(moe_onnx.DOMAIN, 1)]
    )
    types = inferred_types(model)
    assert types["y"] == (TensorProto.BFLOAT16, ["M", 96])
    assert types["dw"] == (TensorProto.BFLOAT16, ["E", 64, 96])


def test_npu_limits():
    info = {
        "x": TensorInfo("float32", (8, 70000)),
        "weight": TensorInfo("float32", (2, 70000, 4)),
        "group_list": TensorInfo("int64", (2,)),
    }
    found = targets.check("GroupedMatmul", info, {"group_type": 0, "transpose_x": 1}, "ascend910b")
    assert any("x's last dim 70000" in f for f in found) and any("only with group_type 2" in f for f in found)
    many = {
        "x": TensorInfo("float32", (8, 4)),
        "weight": TensorInfo("float32", (2000, 4, 4)),
        "group_list": TensorInfo("int64", (2000,)),
    }
    assert targets.check("GroupedMatmul", many, {"group_type": 0}, "ascend910b") == [
        "GroupedMatmul on ascend910b: len(group_list) = 2000 exceeds 1024 groups (one weight tensor)"
    ]


@pytest.mark.parametrize("transpose_weight", [0, 1])
def test_bfloat16_products_are_blas_on_the_exact_float32_values(transpose_weight):
    """bfloat16 x and weight (NaN, inf, subnormal and signed-zero elements among them) give
    the bits of single-threaded BLAS on their float32 casts, rounded once: widening them by
    their bits (the kernel's fast path) changes neither the values nor the layout BLAS sees."""
    from moe_onnx.custom_ops import blas

    bf16 = np.dtype(ml_dtypes.bfloat16)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((40, 24)).astype(bf16)
    stored = rng.standard_normal((3, 24, 20) if not transpose_weight else (3, 20, 24)).astype(bf16)
    specials = np.array([np.nan, np.inf, -np.inf, 1e-40, -0.0], np.float32).astype(bf16)
    x[0, :5] = specials
    stored[1, 0, :5] = specials
    group_list = np.array([10, 10, 40], np.int64)
    (y,) = grouped_matmul(x, stored, None, group_list, group_type=0, transpose_weight=transpose_weight)
    want = np.zeros((40, 20), bf16)
    with blas.single_threaded():
        for e, (first, stop) in enumerate([(0, 10), (10, 10), (10, 40)]):
            w = stored[e].T if transpose_weight else stored[e]
            want[first:stop] = np.matmul(x[first:stop].astype(np.float32), w.astype(np.float32))
    assert_same_bits(y, want)


# --- groups of a few rows: the fixed-order kernel (fused.few_rows_products) ----------------


def fused_multiply_add_float32(a, b, c):
    """``a * b + c`` rounded once to float32 (what a fused multiply-add gives), in numpy, which
    has none: the product of two float32 is exact in float64; the float64 sum is made
    round-to-odd (TwoSum's exact error tells whether it is inexact; an inexact sum with an even
    last bit moves one step towards the exact value), and a round-to-odd value of 53 bits
    rounds to nearest float32 as the exact value does (53 >= 24 + 2: Boldo and Melquiond,
    "Emulation of FMA and correctly rounded sums: proved algorithms using rounding to odd")."""
    p = np.asarray(a, np.float64) * np.asarray(b, np.float64)
    c = np.asarray(c, np.float64)
    s = p + c
    back = s - p
    error = (p - (s - back)) + (c - back)
    even = (s.view(np.int64) & 1) == 0
    s = np.where((error != 0) & even, np.nextafter(s, np.where(error > 0, np.inf, -np.inf)), s)
    return s.astype(np.float32)


def test_the_fused_multiply_add_reference_rounds_once():
    """The reference above against exact rational arithmetic, on cases where rounding the
    float64 sum to float32 would round twice (a tie broken by bits below float64's), and on
    random values."""
    from fractions import Fraction

    def exact(a, b, c):  # correctly rounded to float32: nearest, ties to even
        value = Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c))
        below = np.float32(float(value))
        candidates = [below, np.nextafter(below, np.float32(np.inf)), np.nextafter(below, np.float32(-np.inf))]
        return min(candidates, key=lambda f: (abs(Fraction(float(f)) - value), int(f.view(np.int32)) & 1))

    # (1 + 2^-12)^2 = 1 + 2^-11 + 2^-24: half a float32 step past 1 + 2^-11, a tie; c = 2^-80
    # puts the exact sum just above it (float64 drops c and the tie goes to even: wrong)
    a_tie = np.float32(1 + 2.0**-12)
    tricky = [
        (a_tie, a_tie, np.float32(2.0**-80)),
        (a_tie, a_tie, np.float32(-(2.0**-80))),
        (np.float32(3.0), np.float32(1 / 3), np.float32(-1.0)),
    ]
    rng = np.random.default_rng(0)
    values = (rng.standard_normal((3, 2000)) * 2.0 ** rng.integers(-30, 30, (3, 2000))).astype(np.float32)
    cases = tricky + list(zip(*values, strict=True))
    a, b, c = (np.array(column, np.float32) for column in zip(*cases, strict=True))
    got = fused_multiply_add_float32(a, b, c)
    want = np.array([exact(*case) for case in cases], np.float32)
    assert_same_bits(got, want)
    assert got[0] != np.float32(np.float64(a[0]) * np.float64(b[0]) + np.float64(c[0]))  # the double rounding


def in_order(a, w, bias, compute=np.float32):
    """``a [R, K] @ w [K, N] + bias`` as the few-rows kernel documents its order, written in
    numpy: one float32 (``compute``) sum per element, +0.0 first, k in increasing order, each
    step a fused multiply-add for float32 (for float64, the product rounded, then added: numpy's
    elementwise ops never fuse), then the bias, then one rounding to the output type."""
    a32, w32 = a.astype(compute), w.astype(compute)
    total = np.zeros((a.shape[0], w.shape[1]), compute)
    for k in range(a.shape[1]):
        if compute == np.float32:
            total = fused_multiply_add_float32(a32[:, k : k + 1], w32[k], total)
        else:
            total = total + a32[:, k : k + 1] * w32[k]
    return total if bias is None else total + bias.astype(compute)


def lane_dots_float32(a, w, bias):
    """``a [R, K] @ w [K, N] + bias`` in the single-row kernel's documented order, in numpy: per
    element, 16 float32 partial sums (lane j: the products with k = j mod 16, k in increasing
    order, each product rounded before it is added), added as a tree (lanes j and j + 8, then
    + 4, + 2, + 1), then the last K mod 16 products in k order, then the bias."""
    a32, w32 = a.astype(np.float32), w.astype(np.float32)
    inner, columns = w.shape
    blocked = inner // 16 * 16
    out = np.empty((a.shape[0], columns), np.float32)
    for r in range(a.shape[0]):
        lanes = np.zeros((16, columns), np.float32)
        for k in range(0, blocked, 16):
            lanes = lanes + a32[r, k : k + 16, None] * w32[k : k + 16]
        for half in (8, 4, 2, 1):
            lanes = lanes[:half] + lanes[half : 2 * half]
        total = lanes[0]
        for k in range(blocked, inner):
            total = total + a32[r, k] * w32[k]
        out[r] = total if bias is None else total + bias.astype(np.float32)
    return out


def expected_order(rows, dtype, transpose_weight):
    """The documented order a group of ``rows`` rows takes in few_rows_case's inputs (its
    weights are C-contiguous): "dots" (1-8 float32/bfloat16 rows against a stored [N, K]
    weight), "in order" (the few-rows kernel) or None (BLAS)."""
    if 1 <= rows <= 8 and transpose_weight and np.dtype(dtype) in (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16)):
        return "dots"
    lanes = np.dtype(dtype) in (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16))  # any size against [N, K]
    most = (10**9 if lanes else 64) if transpose_weight else 32
    if 2 <= rows <= most or (rows == 1 and np.dtype(dtype) in (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))):
        return "in order"
    return None


#: rows of the type 0 groups: the 2-3-row groups the first kernel took, then blocks of 8 rows
#: with every remainder (a block of 4, then 1-3 rows), up to each threshold (32 rows against a
#: [K, N] weight, 64 float16 rows against [N, K]) and one past it (BLAS); float32 and bfloat16
#: against [N, K] take every group of 2 rows or more, as lanes in pieces of up to 64 rows (65:
#: 48 + 17; 81: 48 + 33; 150: 64 + 64 + 22; bfloat16 up to 64 rows as tiles: the same sums)
FEW_ROWS_COUNTS = [1, 0, 3, 2, 1, 4, 5, 6, 7, 9, 12, 14, 15, 17, 32, 33, 64, 65, 80, 81, 150]


def few_rows_case(dtype, group_type, transpose_weight, transpose_x, with_bias, seed=0, columns=77, inner=150, rows=7):
    """Inputs whose type 0 groups have FEW_ROWS_COUNTS rows, or ``rows`` rows of x (types 2 and
    -1). N = 77: two blocks of 32 columns, four squares of 16 and a tail of 13; K = 150: tiles
    of 16 and 64 with a remainder (the kernel's tiles; see fused._TILES)."""
    rng = np.random.default_rng(seed)
    counts = np.array(FEW_ROWS_COUNTS)
    if group_type == 0:
        rows = int(counts.sum()) + 1  # one row past the groups
        w = rng.standard_normal((len(counts), inner, columns))
        bias = rng.standard_normal((len(counts), columns)) if with_bias else None
        group_list = np.cumsum(counts).astype(np.int64)
    elif group_type == 2:
        k_counts = np.array([7, 0, 80, 63])
        inner = int(k_counts.sum())
        w, bias, group_list = rng.standard_normal((inner, columns)), None, np.cumsum(k_counts).astype(np.int64)
    else:
        w = rng.standard_normal((inner, columns))
        bias = rng.standard_normal(columns) if with_bias else None
        group_list = None
    x = rng.standard_normal((rows, inner)).astype(dtype)
    w = w.astype(dtype)
    attrs = {"group_type": group_type, "transpose_weight": transpose_weight, "transpose_x": transpose_x}
    if transpose_weight:
        w = np.ascontiguousarray(np.swapaxes(w, -1, -2))
    if transpose_x:
        x = np.ascontiguousarray(x.T)
    if bias is not None:
        bias = bias.astype(np.float16 if dtype == np.float16 else np.float32)
    return {"x": x, "weight": w, "bias": bias, "group_list": group_list}, attrs


FEW_ROWS_LAYOUTS = [
    (group_type, tw, tx, bias)
    for group_type in (0, 2, -1)
    for tw in (0, 1)
    for tx in (0, 1)
    for bias in ((False, True) if group_type != 2 else (False,))
]


@pytest.mark.parametrize("dtype", [*FLOAT_DTYPES, np.float64])
@pytest.mark.parametrize("group_type, transpose_weight, transpose_x, with_bias", FEW_ROWS_LAYOUTS)
def test_few_rows_groups_follow_the_documented_order(dtype, group_type, transpose_weight, transpose_x, with_bias):
    """Groups the fixed-order kernels take (2 to FEW_ROWS_AGAINST_ROWS = 64 float16 rows against
    a weight stored [N, K], any number of float32 and bfloat16, 2 to FEW_ROWS = 32 against [K, N]; single
    rows too for float16/bfloat16; 1-8
    float32/bfloat16 rows against [N, K] as lane dots) give exactly the bits of their documented
    order (numpy, written from the docstring: a float32 chain of fused multiply-adds over k, a
    float64 sum for float64, or the lane sums), and are within float32 rounding of the float64
    products; groups outside the kernels' sizes give BLAS's values (within the same tolerance)."""
    compute = np.float64 if dtype == np.float64 else np.float32
    inputs, attrs = few_rows_case(dtype, group_type, transpose_weight, transpose_x, with_bias)
    (y,) = grouped_matmul(*inputs.values(), **attrs)
    want = reference(*inputs.values(), **attrs)
    absolute = {k: None if v is None else np.abs(v.astype(np.float64)) for k, v in inputs.items()}
    bound = reference(absolute["x"], absolute["weight"], absolute["bias"], inputs["group_list"], **attrs)
    inner = inputs["x"].shape[1 - transpose_x]
    assert_product_close(y, want, bound * inner)

    a = inputs["x"].T if transpose_x else inputs["x"]
    w = np.swapaxes(inputs["weight"], -1, -2) if transpose_weight else inputs["weight"]
    bias, group_list = inputs["bias"], inputs["group_list"]

    def in_documented_order(rows_of_a, matrix, bias_row):
        if expected_order(len(rows_of_a), dtype, transpose_weight) == "dots":
            return lane_dots_float32(rows_of_a, matrix, bias_row).astype(dtype)
        return in_order(rows_of_a, matrix, bias_row, compute).astype(dtype)

    checked = 0
    if group_type == 0:
        off = offsets_of(group_list, 0)
        for e in range(len(off) - 1):
            if expected_order(off[e + 1] - off[e], dtype, transpose_weight):
                part = in_documented_order(a[off[e] : off[e + 1]], w[e], None if bias is None else bias[e])
                assert_same_bits(y[off[e] : off[e + 1]], part)
                checked += 1
    elif group_type == 2:
        off = offsets_of(group_list, 0)
        for e in range(len(off) - 1):
            if off[e + 1] > off[e]:
                assert_same_bits(y[e], in_documented_order(a[:, off[e] : off[e + 1]], w[off[e] : off[e + 1]], None))
                checked += 1
    else:
        assert_same_bits(y, in_documented_order(a, w, bias))
        checked = 1
    # type 0: the groups of 2 rows up to the threshold (14 of them against [N, K], all 18 for
    # float32 and bfloat16, 12 against [K, N]), and the two single rows but float32 against a
    # [K, N] weight and float64
    single_rows_checked = dtype in (np.float16, ml_dtypes.bfloat16) or (dtype == np.float32 and transpose_weight)
    in_kernel = (18 if dtype in (np.float32, ml_dtypes.bfloat16) else 14) if transpose_weight else 12
    type_0 = in_kernel + 2 if single_rows_checked else in_kernel
    assert checked == {0: type_0, 2: 3, -1: 1}[group_type]  # type 2: the three non-empty k groups


def test_which_groups_take_the_few_rows_kernel():
    from moe_onnx.custom_ops.grouped_matmul import (
        FEW_ROWS,
        FEW_ROWS_AGAINST_LARGE,
        FEW_ROWS_AGAINST_ROWS,
        LARGE_WEIGHT,
        few_rows,
        row_dots,
    )

    # the thresholds measured in docs/bench.md: against [K, N], against [N, K] weights, and
    # against [N, K] ones of at least 2^20 elements (a [K, N] one of any size keeps 32);
    # float32 (but single rows) and bfloat16 against [N, K], any number of rows, as the
    # kernel's lanes; float16 against [N, K] up to 64 rows (96 against 2^20 elements or more)
    assert (FEW_ROWS, FEW_ROWS_AGAINST_ROWS, FEW_ROWS_AGAINST_LARGE, LARGE_WEIGHT) == (32, 64, 96, 1 << 20)
    f32, bf16, f16 = np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16)
    cases = [  # (most float32 rows, most bfloat16 rows, most float16 rows, stored as rows, weight elements)
        (FEW_ROWS, FEW_ROWS, FEW_ROWS, False, 0),
        (FEW_ROWS, FEW_ROWS, FEW_ROWS, False, 1 << 24),
        (None, None, FEW_ROWS_AGAINST_ROWS, True, 0),
        (None, None, FEW_ROWS_AGAINST_ROWS, True, (1 << 20) - 1),
        (None, None, FEW_ROWS_AGAINST_LARGE, True, 1 << 20),
    ]
    for most, most_bf16, most_f16, as_rows, elements in cases:
        if most is None:
            taken = [few_rows(r, f32, as_rows, elements) for r in (0, 1, 2, 193, 10**6)]
            assert taken == [False, False, True, True, True]
            taken = [few_rows(r, bf16, as_rows, elements) for r in (0, 1, 2, 193, 10**6)]
            assert taken == [False, True, True, True, True]
        else:
            taken = [few_rows(r, f32, as_rows, elements) for r in range(most + 2)]
            assert taken == [False, False] + [True] * (most - 1) + [False]
            taken = [few_rows(r, bf16, as_rows, elements) for r in range(most_bf16 + 2)]
            assert taken == [False] + [True] * most_bf16 + [False]
        taken = [few_rows(r, f16, as_rows, elements) for r in range(most_f16 + 2)]
        assert taken == [False] + [True] * most_f16 + [False]
    assert not few_rows(1, np.dtype(np.float64), False) and few_rows(2, np.dtype(np.float64), False)
    # 1-8 float32 / bfloat16 rows against a weight stored [N, K] take the lane dot kernel
    f16, f64 = np.dtype(np.float16), np.dtype(np.float64)
    assert [row_dots(r, f32, True) for r in range(10)] == [False] + [True] * 8 + [False]
    assert [row_dots(r, bf16, True) for r in range(10)] == [False] + [True] * 8 + [False]
    assert not any([row_dots(1, f32, False), row_dots(2, bf16, False), row_dots(1, f16, True), row_dots(1, f64, True)])


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
@pytest.mark.parametrize("inner", [1, 16, 150, 1029])
def test_rows_against_rows_of_weights_are_lane_sums_whatever_the_threads(dtype, inner):
    """Groups of 1-8 rows against a stored [N, K] weight: the bits of the lane-sum order (numpy,
    written from the docstring), with a bias, on 1 and 2 threads (a weight big enough to be
    split over the output columns), x given transposed too, and for group types 2 and -1."""
    rng = np.random.default_rng(inner)
    columns = 1500 if inner > 16 else 37  # 1500 x 1029 float32: 6 MB, split over the threads
    x = rng.standard_normal((17, inner)).astype(dtype)
    stored = rng.standard_normal((4, columns, inner)).astype(dtype)  # [E, N, K]
    bias = rng.standard_normal((4, columns)).astype(np.float32)
    counts = np.array([1, 0, 7, 8], np.int64)  # 1, 0, 7 and 8 rows (blocks of 4 and their rests)
    first_rows = np.concatenate([[0], np.cumsum(counts)])
    want = [
        lane_dots_float32(x[first_rows[e] : first_rows[e + 1]], stored[e].T, bias[e]).astype(dtype) for e in range(4)
    ]
    saved = parallel._MAX_WORKERS
    try:
        for threads in (1, 2):
            parallel._MAX_WORKERS = threads
            for x_given, transpose_x in ((x, 0), (np.ascontiguousarray(x.T), 1)):
                (y,) = grouped_matmul(
                    x_given, stored, bias, counts, group_type=0, group_list_type=1,
                    transpose_weight=1, transpose_x=transpose_x,
                )  # fmt: skip
                for e in range(4):
                    assert_same_bits(y[first_rows[e] : first_rows[e + 1]], want[e])
                assert not y[16:].any()  # past the groups
            (y,) = grouped_matmul(x[1:8], stored[2], bias[2], None, group_type=-1, transpose_weight=1)
            assert_same_bits(y, want[2])
            k_counts = np.array([inner // 3, inner - inner // 3], np.int64)
            (y,) = grouped_matmul(x[:3], stored[0], None, np.cumsum(k_counts), group_type=2, transpose_weight=1)
            first = int(k_counts[0])
            if first:
                assert_same_bits(y[0], lane_dots_float32(x[:3, :first], stored[0, :, :first].T, None).astype(dtype))
            assert_same_bits(y[1], lane_dots_float32(x[:3, first:], stored[0, :, first:].T, None).astype(dtype))
    finally:
        parallel._MAX_WORKERS = saved


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_lane_dots_as_a_compiled_call_take_every_share_with_the_same_bits(dtype, monkeypatch):
    """On two threads the lane dots run as one compiled call (the helper takes column shares
    without the GIL): the same bits as the shares taken through Python, the lane-sum order,
    with and without a bias, x given transposed too; and nothing is left posted."""
    from moe_onnx.custom_ops import fused

    monkeypatch.setattr(parallel, "_cpu_count", lambda: 2)
    monkeypatch.setattr(parallel, "_MAX_WORKERS", 4)
    rng = np.random.default_rng(7)
    x = rng.standard_normal((6, 300)).astype(dtype)
    stored = rng.standard_normal((3, 2100, 300)).astype(dtype)  # [E, N, K]: 2.5 MB a group in float32
    bias = rng.standard_normal((3, 2100)).astype(np.float32)
    counts = np.array([1, 0, 5], np.int64)
    compiled_calls = []
    real = fused.run_compiled

    def counted(descriptor, parts):
        ran = real(descriptor, parts)
        compiled_calls.append((ran, parts))
        return ran

    def product(x_given, transpose_x, with_bias):
        return grouped_matmul(
            x_given, stored, bias if with_bias else None, counts, group_type=0, group_list_type=1,
            transpose_weight=1, transpose_x=transpose_x,
        )[0]  # fmt: skip

    cases = [(x, 0, True), (np.ascontiguousarray(x.T), 1, False)]
    monkeypatch.setattr(fused, "run_compiled", counted)
    compiled = [product(*case) for case in cases]
    assert compiled_calls and all(ran and parts > 1 for ran, parts in compiled_calls)
    monkeypatch.setattr(fused, "run_compiled", lambda descriptor, parts: False)
    through_python = [product(*case) for case in cases]
    for (_, _, with_bias), y, y_python in zip(cases, compiled, through_python, strict=True):
        assert_same_bits(y, y_python)
        first_bias, third_bias = (bias[0], bias[2]) if with_bias else (None, None)
        assert_same_bits(y[:1], lane_dots_float32(x[:1], stored[0].T, first_bias).astype(dtype))
        assert_same_bits(y[1:6], lane_dots_float32(x[1:6], stored[2].T, third_bias).astype(dtype))
    helpers = parallel._helpers()
    assert helpers._counters[parallel.OPEN] == 0 and helpers._counters[parallel.INSIDE] == 0


def test_lane_dots_compile_to_vectors_without_fused_multiply_add():
    """The lane-sum order rounds every product before adding it: the compiled lane dot kernel
    (a fresh compile, float32 and bfloat16 bits, blocks of 1-4 rows) holds no fused
    multiply-add, and on an x86 CPU with AVX its sums are packed-vector adds and multiplies,
    its 4-row blocks prefetching the weight rows further on (here past the weight's end: a
    prefetch never faults, and the values are the same)."""
    import platform
    import re

    from numba import njit

    from moe_onnx.custom_ops import fused_loops

    kernel = njit(nogil=True)(fused_loops._lane_dot_products.py_func)
    jobs = np.array([[0, 0, 40, 0, 7, 0]], np.int64)
    for carrier in (np.float32, np.uint16):
        one = np.float32(1) if carrier == np.float32 else np.uint16(0x3F80)  # bfloat16 1.0
        x, w, out = np.full((7, 40), one), np.full((1, 7, 40), one), np.zeros((1, 7, 7), carrier)
        xs, sums = np.empty((7, 40), np.float32), np.empty((4, 4), np.float32)
        kernel(x, 0 if carrier == np.float32 else 1, False, w, None, 0, jobs, out, 0, 7, xs, sums)
        assert (out == (np.float32(40) if carrier == np.float32 else np.uint16(0x4220))).all()  # 40.0 (bfloat16 0x4220)
    avx = platform.machine() == "x86_64" and " avx " in open("/proc/cpuinfo").read().replace("\n", " ")
    for asm in kernel.inspect_asm().values():
        assert not re.search(FUSED_MULTIPLY_ADD, asm)
        if avx:
            assert re.search(r"vmulps\s+[^\n]*[yz]mm", asm) and re.search(r"vaddps\s+[^\n]*[yz]mm", asm)
            assert re.search(r"\bprefetcht0\b", asm)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_few_rows_kernel_splits_columns_with_the_same_bits(dtype):
    """In one process: the kernel on 1 thread and on 2 (a weight big enough to be split),
    called twice each, bit-identical; the bits of the in-order float32 sum (numpy), and against
    the stored [N, K] layout those of the lane-sum order for groups of at most 8 float32 /
    bfloat16 rows."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((24, 300)).astype(dtype)
    w = rng.standard_normal((3, 300, 1200)).astype(dtype)  # [E, K, N]: 4.3 MB as float32
    bias = rng.standard_normal((3, 1200)).astype(np.float16 if dtype == np.float16 else np.float32)
    group_list = np.array([2, 7, 24], np.int64)  # 2, 5, 17 rows: every group in the kernel
    outputs = []
    saved = parallel._MAX_WORKERS
    try:
        for threads in (1, 2, 1, 2):
            parallel._MAX_WORKERS = threads
            outputs.append(grouped_matmul(x, w, bias, group_list, group_type=0)[0])
            stored = np.ascontiguousarray(np.swapaxes(w, 1, 2))
            outputs.append(grouped_matmul(x, stored, bias, group_list, group_type=0, transpose_weight=1)[0])
    finally:
        parallel._MAX_WORKERS = saved
    for y in outputs[2::2]:  # [K, N]: the k-order kernel
        assert_same_bits(y, outputs[0])
    for y in outputs[3::2]:  # [N, K]: the same, but groups of <= 8 float32/bfloat16 rows (lane dots)
        assert_same_bits(y, outputs[1])
    for e, (first, stop) in enumerate([(0, 2), (2, 7), (7, 24)]):
        assert_same_bits(outputs[0][first:stop], in_order(x[first:stop], w[e], bias[e]).astype(dtype))
        lane_dots = stop - first <= 8 and dtype != np.float16
        order = lane_dots_float32 if lane_dots else in_order
        assert_same_bits(outputs[1][first:stop], order(x[first:stop], w[e], bias[e]).astype(dtype))


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
@pytest.mark.parametrize("inner", [1024, 1023])
def test_groups_of_any_size_against_rows_of_weights_take_the_kernel(dtype, inner):
    """Float32 and bfloat16 groups against a weight stored [N, K], large (1024 x 1024) or not
    (1024 x 1023), of 64, 81, 193 and 600 rows (bfloat16 64 rows: tiles; the rest pieces of
    up to 64 rows in lanes: 48 + 33, 3 x 64 + 1, 9 x 64 + 24) give the bits of the kernel's
    order (a float32 chain of fused multiply-adds over k in order; checked on 40 of the
    columns, which are independent sums): no size goes to BLAS."""
    rng = np.random.default_rng(11)
    counts = np.array([64, 81, 193, 600], np.int64)
    x = rng.standard_normal((int(counts.sum()), inner)).astype(dtype)
    stored = rng.standard_normal((len(counts), 1024, inner)).astype(dtype)  # [E, N, K]
    columns = np.r_[0:24, 1000:1016]
    (y,) = grouped_matmul(x, stored, None, counts, group_type=0, group_list_type=1, transpose_weight=1)
    bounds = np.r_[0, np.cumsum(counts)]
    for e in range(len(counts)):
        a = x[bounds[e] : bounds[e + 1]]
        want = in_order(a, stored[e].T[:, columns], None).astype(dtype)
        assert_same_bits(y[bounds[e] : bounds[e + 1], columns], want)


def test_rows_put_in_lanes_by_several_threads_keep_the_documented_order(monkeypatch):
    """When the rows in lanes fill megabytes (16 groups of 40 rows over 1024 k: 3 MB) and the
    output columns are split over the threads (here forced: 16 jobs would be split whole), the
    threads transpose them in ranges of jobs first: the bits of the documented order on 1 and 2
    threads."""
    from moe_onnx.custom_ops import fused

    monkeypatch.setattr(fused, "_JOBS_PER_WORKER", 1 << 30)
    rng = np.random.default_rng(8)
    counts = np.full(16, 40, np.int64)
    x = rng.standard_normal((640, 1024)).astype(np.float32)
    stored = rng.standard_normal((16, 64, 1024)).astype(np.float32)  # [E, N, K]
    saved = parallel._MAX_WORKERS
    try:
        outputs = []
        for threads in (1, 2):
            parallel._MAX_WORKERS = threads
            (y,) = grouped_matmul(x, stored, None, counts, group_type=0, group_list_type=1, transpose_weight=1)
            outputs.append(y)
    finally:
        parallel._MAX_WORKERS = saved
    assert_same_bits(outputs[1], outputs[0])
    for e in range(16):
        rows = slice(40 * e, 40 * (e + 1))
        assert_same_bits(outputs[0][rows], in_order(x[rows], stored[e].T, None))


def test_jobs_are_cut_into_pieces_that_cover_their_rows_once():
    """Row lanes take a job in pieces of at most ROW_LANE_ROWS rows: as few as hold it, none
    empty, together its rows once each, in order, every other column unchanged."""
    from moe_onnx.custom_ops import fused

    most = fused.ROW_LANE_ROWS
    counts = np.arange(1, 300)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    jobs = np.stack([counts % 7, counts % 3, counts % 3 + 5, starts, starts + counts, counts % 2], axis=1)
    cut, pieces = fused._in_pieces(jobs, most)
    rows = cut[:, 4] - cut[:, 3]
    assert rows.min() >= 1 and rows.max() <= most
    assert np.array_equal(cut[1:, 3], cut[:-1, 4])  # contiguous: every row once, in order
    owner = np.searchsorted(starts, cut[:, 3], side="right") - 1
    assert np.array_equal(cut[:, [0, 1, 2, 5]], jobs[owner][:, [0, 1, 2, 5]])
    assert np.array_equal(np.bincount(owner, minlength=len(jobs)), -(-counts // most))
    assert np.array_equal(pieces, -(-counts // most))


def test_job_shares_cover_every_job_once_whole_callers_jobs_biggest_first(monkeypatch):
    """At prefill the threads take shares of whole jobs: ranges that start where one of the
    caller's jobs starts (its pieces stay together), cover every row of jobs once, about
    _JOB_SHARES_PER_WORKER a worker, the biggest (rows x depth) first; too few jobs, too little
    weight, one worker, or one job more work than a thread's part, and the columns are split
    instead (None)."""
    from moe_onnx.custom_ops import fused

    monkeypatch.setattr(parallel, "_cpu_count", lambda: 2)
    monkeypatch.setattr(parallel, "_MAX_WORKERS", 2)
    rng = np.random.default_rng(9)
    counts = rng.integers(1, 120, 70)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    callers = np.stack([np.arange(70), 0 * counts, 0 * counts + 512, starts, starts + counts, 0 * counts], axis=1)
    jobs, pieces = fused._in_pieces(callers, fused.ROW_LANE_ROWS)
    shares = fused._job_shares(jobs, pieces, 4 * 4096)
    assert shares is not None
    bounds = sorted(shares)
    assert bounds[0][0] == 0 and bounds[-1][1] == len(jobs)
    assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(bounds, bounds[1:], strict=False))  # once each, in order
    caller_starts = set((np.cumsum(pieces) - pieces).tolist())
    assert all(first in caller_starts for first, _ in shares)
    work = [int(((jobs[a:b, 4] - jobs[a:b, 3]) * 512).sum()) for a, b in shares]
    assert work == sorted(work, reverse=True)
    assert 1 < len(shares) <= fused._JOB_SHARES_PER_WORKER * 2
    assert fused._job_shares(jobs[:3], pieces[:3], 4 * 4096) is None  # 3 jobs: the columns
    assert fused._job_shares(jobs, pieces, 4) is None  # bytes of weight: one thread's work
    lopsided = callers[:8].copy()  # 192 rows, then 7 groups of 10: the first over half the work
    lopsided[:, 3] = np.concatenate([[0], 192 + 10 * np.arange(7)])
    lopsided[:, 4] = lopsided[:, 3] + np.array([192] + [10] * 7)
    assert fused._job_shares(*fused._in_pieces(lopsided, fused.ROW_LANE_ROWS), 4 * 4096) is None
    lopsided[0, 4] = 60  # 60 rows, then 7 of 10: whole groups
    lopsided[1:, 3:5] -= 132
    assert fused._job_shares(*fused._in_pieces(lopsided, fused.ROW_LANE_ROWS), 4 * 4096) is not None
    monkeypatch.setattr(parallel, "_MAX_WORKERS", 1)
    assert fused._job_shares(jobs, pieces, 4 * 4096) is None


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
@pytest.mark.parametrize("transpose_x, with_bias", [(0, False), (1, True)])
def test_jobs_split_over_the_threads_keep_the_documented_order(dtype, transpose_x, with_bias, monkeypatch):
    """40 groups of 0-149 rows (float32 ones, and bfloat16 ones over 64, in lanes, cut into
    pieces of up to four vectors of 16, so every kernel of 1-4 vectors runs; bfloat16 ones of
    up to 64 rows in tiles, in the same calls), against a [N, K] weight
    of 5 MB (float32; bfloat16 2.6), x given transposed too, with a bias: the jobs split whole
    over 2 threads (also taking the columns a block at a time), or the columns (forced), or on
    1 thread: the same bits each way, the documented order's."""
    from moe_onnx.custom_ops import fused

    monkeypatch.setattr(parallel, "_cpu_count", lambda: 2)
    rng = np.random.default_rng(10)
    counts = rng.integers(9, 150, 40)
    counts[[3, 17]] = 0
    x = rng.standard_normal((int(counts.sum()) + 5, 256)).astype(dtype)
    stored = rng.standard_normal((40, 128, 256)).astype(dtype)  # [E, N, K]
    bias = rng.standard_normal((40, 128)).astype(np.float32) if with_bias else None
    x_given = np.ascontiguousarray(x.T) if transpose_x else x
    split = fused._job_shares
    taken = []
    monkeypatch.setattr(fused, "_job_shares", lambda *args: taken.append(split(*args)) or taken[-1])
    outputs = []
    for threads, jobs_per_worker, block in ((1, 4, 2048), (2, 1, 2048), (2, 1, 32), (2, 1 << 30, 2048)):
        monkeypatch.setattr(parallel, "_MAX_WORKERS", threads)
        monkeypatch.setattr(fused, "_JOBS_PER_WORKER", jobs_per_worker)
        monkeypatch.setattr(fused, "_JOB_SHARE_COLUMNS", block)
        (y,) = grouped_matmul(
            x_given, stored, bias, counts, group_type=0, group_list_type=1, transpose_weight=1, transpose_x=transpose_x
        )
        outputs.append(y)
    assert [share is not None for share in taken] == [False, True, True, False]
    for y in outputs[1:]:
        assert_same_bits(y, outputs[0])
    first = 0
    for e, rows in enumerate(counts.tolist()):
        part = slice(first, first + rows)
        want = in_order(x[part], stored[e].T, None if bias is None else bias[e]).astype(dtype)
        assert_same_bits(outputs[0][part], want)
        first += rows
    assert not outputs[0][first:].any()


def test_split_k_jobs_split_over_the_threads_keep_the_documented_order(monkeypatch):
    """group_type 2 (every job the same rows, another k range and output): its 40 jobs split
    whole over 2 threads give the bits of the documented order."""
    from moe_onnx.custom_ops import fused

    monkeypatch.setattr(parallel, "_cpu_count", lambda: 2)
    monkeypatch.setattr(parallel, "_MAX_WORKERS", 2)
    monkeypatch.setattr(fused, "_JOBS_PER_WORKER", 1)
    split = fused._job_shares
    taken = []
    monkeypatch.setattr(fused, "_job_shares", lambda *args: taken.append(split(*args)) or taken[-1])
    rng = np.random.default_rng(12)
    k_counts = rng.integers(20, 60, 40)
    x = rng.standard_normal((40, int(k_counts.sum()))).astype(np.float32)  # 40 rows: lanes
    stored = rng.standard_normal((400, int(k_counts.sum()))).astype(np.float32)  # [N, Ktot]
    (y,) = grouped_matmul(x, stored, None, np.cumsum(k_counts), group_type=2, transpose_weight=1)
    assert taken and taken[0] is not None
    first = 0
    for e, depth in enumerate(k_counts.tolist()):
        part = slice(first, first + depth)
        assert_same_bits(y[e], in_order(x[:, part], stored[:, part].T, None))
        first += depth


@pytest.mark.parametrize("transpose_x", [0, 1])
@pytest.mark.parametrize("counts", [(13, 14), (20, 31), (40, 45), (64, 57)])
def test_groups_of_9_to_64_float32_rows_in_lanes_keep_the_documented_order(transpose_x, counts):
    """Groups of 9-64 float32 rows against an [N, K] weight are summed with their rows in
    the vector lanes (one to four vectors of 16): the bits of the documented order still,
    with a bias, for a first group whose last vector's 16 rows lie in x (its lanes hold the
    next group's rows too) and a second at x's end (one element at a time), K with a
    remainder past 16, and on 1 and 2 threads (2.2 MB of weight: two column shares, [0, 32)
    and [32, 90), whose blocks of 16, 8 and 4 columns end 2 short)."""
    rng = np.random.default_rng(12)
    counts = np.array(counts, np.int64)
    x = rng.standard_normal((int(counts.sum()), 3000)).astype(np.float32)
    stored = rng.standard_normal((2, 90, 3000)).astype(np.float32)  # [E, N, K]
    bias = rng.standard_normal((2, 90)).astype(np.float32)
    given = np.ascontiguousarray(x.T) if transpose_x else x
    saved = parallel._MAX_WORKERS
    try:
        outputs = []
        for threads in (1, 2):
            parallel._MAX_WORKERS = threads
            attrs = {"group_type": 0, "group_list_type": 1, "transpose_weight": 1, "transpose_x": transpose_x}
            (y,) = grouped_matmul(given, stored, bias, counts, **attrs)
            outputs.append(y)
    finally:
        parallel._MAX_WORKERS = saved
    assert_same_bits(outputs[1], outputs[0])
    first = 0
    for e, rows in enumerate(counts.tolist()):
        want = in_order(x[first : first + rows], stored[e].T, bias[e])
        assert_same_bits(outputs[0][first : first + rows], want)
        first += rows


@pytest.mark.parametrize("group_type", [2, -1])
def test_twelve_rows_in_lanes_for_split_k_and_one_product(group_type):
    """Types 2 (split K, groups of 7, 0, 80 and 63 k) and -1 (one product, with a bias) with 12
    float32 rows against an [N, K]-stored weight take the rows-in-lanes kernel: the bits of the
    documented order (an empty k group: zeros)."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((12, 150)).astype(np.float32)
    w = rng.standard_normal((150, 77)).astype(np.float32)  # W [K, N], stored [N, K] below
    stored = np.ascontiguousarray(w.T)
    if group_type == 2:
        k_counts = np.array([7, 0, 80, 63])
        (y,) = grouped_matmul(x, stored, None, np.cumsum(k_counts), group_type=2, transpose_weight=1)
        off = np.concatenate([[0], np.cumsum(k_counts)])
        for e in range(len(k_counts)):
            want = in_order(x[:, off[e] : off[e + 1]], w[off[e] : off[e + 1]], None)
            assert_same_bits(y[e], want)
    else:
        bias = rng.standard_normal(77).astype(np.float32)
        (y,) = grouped_matmul(x, stored, bias, None, group_type=-1, transpose_weight=1)
        assert_same_bits(y, in_order(x, w, bias))


def test_few_rows_kernel_compiles_to_fused_multiply_adds_in_vectors():
    """The documented order takes each product by a fused multiply-add: on an x86 CPU with FMA,
    the compiled kernel (a fresh, uncached compile for float32 and for bfloat16 bits) sums in
    packed-vector fused multiply-adds and multiplies nothing apart (a separate rounded product
    would be another order)."""
    import platform
    import re

    from numba import njit

    from moe_onnx.custom_ops import fused_loops

    kernel = njit(nogil=True)(fused_loops._few_rows_products.py_func)
    jobs = np.array([[0, 0, 40, 0, 5, 0]], np.int64)
    for carrier in (np.float32, np.uint16):
        x = np.ones((5, 40), carrier)
        w = np.ones((1, 70, 40), carrier)  # [G, N, K]: the transposed tiles
        out = np.zeros((1, 5, 70), carrier)
        xs, acc, tile = np.empty((5, 40), np.float32), np.empty((5, 32), np.float32), np.empty((64, 32), np.float32)
        kind = 0 if carrier == np.float32 else 1
        slots, xt, lane_sums = (
            np.full(1, -1, np.int64),
            np.empty((0, 40, 16), np.float32),
            np.empty(256, np.float32),
        )
        kernel(x, kind, False, w, True, None, 0, jobs, out, 0, 70, xs, acc, tile, slots, xt, lane_sums)
    fma = platform.machine() == "x86_64" and " fma " in open("/proc/cpuinfo").read().replace("\n", " ")
    for asm in kernel.inspect_asm().values():
        if fma:
            assert re.search(r"vfn?madd\d*ps\s+[^\n]*[yz]mm", asm)
            assert not re.search(r"v?mul[ps]s\b", asm)


#: x86's fused multiply-add mnemonics (vfmadd231ps, vfnmsub213ss, ...)
FUSED_MULTIPLY_ADD = r"\bv?fn?m(add|sub)\d*[ps][sd]\b"


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_few_rows_kernel_takes_weight_views(dtype):
    """The kernel reads weight tiles by address: a weight given as a view (the other layout's
    storage swapped, or every other row) gives the bits of the in-order float32 sum."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((11, 100)).astype(dtype)
    stored = rng.standard_normal((2, 180, 100)).astype(dtype)  # [E, N, K]
    bias = rng.standard_normal((2, 90)).astype(np.float32)
    views = [
        (0, np.swapaxes(stored[:, :90], 1, 2)),  # [E, K, N], not C-contiguous
        (1, np.swapaxes(np.ascontiguousarray(np.swapaxes(stored[:, :90], 1, 2)), 1, 2)),  # [E, N, K] view
        (1, stored[:, ::2]),  # every other row: 90 of them
        (0, np.swapaxes(stored[:, ::2], 1, 2)[:, :, :]),
    ]
    for transpose_weight, w in views:
        assert not w.flags.c_contiguous
        (y,) = grouped_matmul(x, w, bias, np.array([5, 11]), group_type=0, transpose_weight=transpose_weight)
        matrices = np.swapaxes(w, 1, 2) if transpose_weight else w
        for e, (first, stop) in enumerate([(0, 5), (5, 11)]):
            want = in_order(x[first:stop], matrices[e], bias[e]).astype(dtype)
            assert_same_bits(y[first:stop], want)
