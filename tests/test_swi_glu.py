"""SwiGlu and SwiGluGrad (SPEC-layer 1.10): kernels against float64 references of the SPEC
formulas, the grad against the VJP of the forward kernel, sessions bit-identical with the
kernels, errors, shape inference, determinism."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from onnx import TensorProto, helper

import moe_onnx
from moe_onnx.custom_ops import TensorInfo, targets
from moe_onnx.custom_ops.swi_glu import swi_glu
from moe_onnx.custom_ops.swi_glu_grad import swi_glu_grad
from tests.support import assert_refused, assert_same_bits, inferred_types, run_node

FLOAT_DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16]


def halves(x: np.ndarray, dim: int) -> tuple[np.ndarray, np.ndarray]:
    a, b = np.split(x.astype(np.float64), 2, axis=dim)
    return a, b


FLOAT32_MAX = float(np.finfo(np.float32).max)


def sigmoid(a: np.ndarray) -> np.ndarray:
    """float64 sigmoid with float32's range: exp(-a) beyond float32's largest value is inf
    (sigmoid 0), as float32 arithmetic (the SPEC's) gives."""
    with np.errstate(over="ignore"):
        e = np.exp(-a)
    return 1 / (1 + np.where(e > FLOAT32_MAX, np.inf, e))


def reference(x: np.ndarray, dim: int) -> np.ndarray:
    """SPEC-layer 1.10 in float64: a * sigmoid(a) * b, the gate half first."""
    a, b = halves(x, dim)
    return a * sigmoid(a) * b


def reference_grad(g: np.ndarray, x: np.ndarray, dim: int) -> np.ndarray:
    a, b = halves(x, dim)
    s = sigmoid(a)
    g = g.astype(np.float64)
    return np.concatenate([g * b * s * (1 + a * (1 - s)), g * a * s], axis=dim)


EPS32 = float(np.finfo(np.float32).eps)


def assert_within_rounding(got: np.ndarray, want: np.ndarray, bound: np.ndarray) -> None:
    """|got - want| <= 8 eps32 * bound (the float32 arithmetic; ``bound`` >= the terms'
    magnitudes) + half an ulp of ``want`` in got's dtype (the one rounding at the end)."""
    eps = float(ml_dtypes.finfo(got.dtype).eps)
    tiny = float(ml_dtypes.finfo(got.dtype).smallest_normal)
    error = np.abs(got.astype(np.float64) - want)
    allowed = 8 * EPS32 * bound + 0.5 * eps * np.abs(want) + tiny
    worst = np.argmax(error - allowed)
    assert (error <= allowed).all(), f"{error.flat[worst]} > {allowed.flat[worst]} at {worst}"


@st.composite
def cases(draw):
    rank = draw(st.integers(1, 4))
    shape = [draw(st.integers(1, 5)) for _ in range(rank)]
    dim = draw(st.integers(-rank, rank - 1))
    shape[dim] *= 2
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    scale = draw(st.sampled_from([1.0, 8.0, 40.0]))  # 40: sigmoid saturates (exp over- and underflow)
    x = (rng.standard_normal(shape) * scale).astype(draw(st.sampled_from(FLOAT_DTYPES)))
    return x, dim, rng


@given(cases())
def test_forward_matches_the_formula(case):
    x, dim, _ = case
    (y,) = swi_glu(x, dim=dim)
    assert_within_rounding(y, reference(x, dim), np.abs(reference(x, dim)))


@given(cases())
def test_grad_matches_the_derivative(case):
    x, dim, rng = case
    shape = list(x.shape)
    shape[dim] //= 2
    g = rng.standard_normal(shape).astype(x.dtype)
    (x_grad,) = swi_glu_grad(g, x, dim=dim)
    a, b = halves(x, dim)
    bound = np.abs(g.astype(np.float64)) * (np.abs(b) * (1 + np.abs(a)) + np.abs(a))
    assert_within_rounding(x_grad, reference_grad(g, x, dim), np.concatenate([bound, bound], axis=dim))


def forward_jacobian(x: np.ndarray, dim: int) -> np.ndarray:
    """d y / d x of the forward kernel in float64 by central differences, [y.size, x.size]."""
    step = 1e-6
    columns = []
    for k in range(x.size):
        unit = np.zeros(x.size)
        unit[k] = step
        plus = swi_glu(x + unit.reshape(x.shape), dim=dim)[0]
        minus = swi_glu(x - unit.reshape(x.shape), dim=dim)[0]
        columns.append(((plus - minus) / (2 * step)).ravel())
    return np.stack(columns, axis=1)


@pytest.mark.parametrize("dim", [-1, 0, 1])
def test_grad_is_the_vjp_of_the_forward_float64(dim):
    """J^T g, J from the forward kernel itself (float64 bare kernels)."""
    rng = np.random.default_rng(dim + 5)
    x = rng.standard_normal((4, 6))
    shape = list(x.shape)
    shape[dim] //= 2
    g = rng.standard_normal(shape)
    (x_grad,) = swi_glu_grad(g, x, dim=dim)
    assert x_grad.dtype == np.float64
    vjp = (forward_jacobian(x, dim).T @ g.ravel()).reshape(x.shape)
    np.testing.assert_allclose(x_grad, vjp, rtol=1e-7, atol=1e-8)


def test_sigmoid_is_within_2_5_ulps():
    """The vectorised float32 sigmoid against float64, over every a whose sigmoid is normal."""
    from numba import njit

    from moe_onnx.custom_ops import fused_loops

    @njit(error_model="numpy")
    def vectorised_sigmoid(a):
        s = np.empty_like(a)
        fused_loops._sigmoid_into(a, s, np.empty(len(a), np.int32))
        return s

    a = np.linspace(-87.0, 88.7, 2_000_001, dtype=np.float32)
    exact = 1 / (1 + np.exp(-a.astype(np.float64)))
    ulps = np.abs(vectorised_sigmoid(a) - exact) / np.spacing(exact.astype(np.float32)).astype(np.float64)
    assert ulps.max() <= 2.5, (ulps.max(), a[np.argmax(ulps)])


def test_float64_kernel_is_the_formula_exactly():
    x = np.random.default_rng(1).standard_normal((3, 8)) * 5
    np.testing.assert_allclose(swi_glu(x)[0], reference(x, -1), rtol=1e-15, atol=0)


def test_worked_example():
    """x = [a | b]: a = 0 gives 0; a = ln 3 gives sigmoid 3/4."""
    a = np.log(3.0)
    x = np.array([[0.0, a, 2.0, 4.0]], np.float32)
    (y,) = run_node("SwiGlu", {"x": x})
    np.testing.assert_allclose(y, [[0.0, a * 0.75 * 4.0]], rtol=2e-7)


def test_saturation_and_specials():
    x = np.array([[-200.0, 200.0, 0.0, -0.0, np.inf, np.nan, 3.0, 3.0, 3.0, 3.0, 3.0, 3.0]], np.float32)
    (y,) = swi_glu(x)  # a = x[:6], b = 3: sigmoid(-200) is 0, sigmoid(200) and sigmoid(inf) are 1
    np.testing.assert_array_equal(y[0, :5], [0.0, 600.0, 0.0, 0.0, np.inf])
    assert np.isnan(y[0, 5])


@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=lambda d: np.dtype(d).name)
def test_sessions_equal_the_kernels(dtype):
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((5, 3, 8)) * 4).astype(dtype)
    for dim in (-1, 1, 0):
        if x.shape[dim] % 2:
            continue
        (y,) = run_node("SwiGlu", {"x": x}, {"dim": dim})
        assert_same_bits(y, swi_glu(x, dim=dim)[0])
        g = rng.standard_normal(y.shape).astype(dtype)
        (x_grad,) = run_node("SwiGluGrad", {"y_grad": g, "x": x}, {"dim": dim})
        assert_same_bits(x_grad, swi_glu_grad(g, x, dim=dim)[0])


def test_large_call_is_split_over_threads_and_deterministic():
    """> 16 MiB: the rows run on several threads; every run gives the same bits."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2048, 4096)).astype(ml_dtypes.bfloat16)
    first = swi_glu(x)[0]
    assert_same_bits(first, swi_glu(x)[0])
    rows = [swi_glu(x[i : i + 1])[0] for i in (0, 777, 2047)]  # one row alone: one thread
    for i, row in zip((0, 777, 2047), rows):
        assert_same_bits(row[0], first[i])


# --- errors ------------------------------------------------------------------------------


def test_error_odd_size_along_dim():
    assert_refused(
        lambda: run_node("SwiGlu", {"x": np.ones((2, 5), np.float32)}), 561002, "even size along dim -1", "[2, 5]"
    )


def test_error_dim_out_of_range():
    assert_refused(
        lambda: run_node("SwiGlu", {"x": np.ones((2, 4), np.float32)}, {"dim": 2}), 561002, "dim must be in [-2, 2)"
    )


def test_error_rank():
    assert_refused(lambda: moe_onnx.OPS["SwiGlu"](np.ones((), np.float32)), 561002, "rank 1 to 8")
    assert_refused(lambda: moe_onnx.OPS["SwiGlu"](np.ones((2,) * 9, np.float32)), 561002, "rank 1 to 8")


def test_error_dtype():
    assert_refused(lambda: run_node("SwiGlu", {"x": np.ones((2, 4), np.float64)}), 161002, "'x' has dtype float64")


def test_error_grad_shape_and_dtype():
    x = np.ones((2, 4), np.float32)
    assert_refused(
        lambda: run_node("SwiGluGrad", {"y_grad": np.ones((2, 4), np.float32), "x": x}),
        561002,
        "y_grad must be x's shape with dim -1 halved: dim 1 (got 4 and 2)",
    )
    assert_refused(
        lambda: run_node("SwiGluGrad", {"y_grad": np.ones((2, 2), np.float16), "x": x}),
        161002,
        "y_grad must have x's dtype (float32), got float16",
    )


def test_shape_inference():
    node = helper.make_node("SwiGlu", ["x"], ["y"], domain=moe_onnx.DOMAIN, dim=1)
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("x", TensorProto.BFLOAT16, ["T", 6, "H"])], []
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(moe_onnx.DOMAIN, 1)]
    )
    assert inferred_types(model)["y"] == (TensorProto.BFLOAT16, ["T", 3, "H"])


def test_npu_limit_empty_tensor():
    info = TensorInfo("float32", (0, 4))
    assert targets.check("SwiGlu", {"x": info}, {}, "ascend910b") == [
        "SwiGlu on ascend910b: x of shape [0, 4] is empty (the NPU refuses empty tensors)"
    ]
    assert targets.check("SwiGlu", {"x": TensorInfo("float32", (2, 4))}, {}, "ascend910b") == []
