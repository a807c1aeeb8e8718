"""What the gating bodies share (SPEC 1.13, 1.14), as the kernels define it (custom_ops/gating.py).

* Scores are computed in double and cast once to float: the same float32 as the kernels' (both
  are the float32 nearest the exact value, but for values within ~1e-15 of a rounding boundary).
* Rankings use ``TopK(largest=1, sorted=1)``, whose ties go to the lower index (ONNX's
  contract; onnxruntime and onnx.reference keep it). NaN values are replaced by -inf first, as
  the kernels rank them; -0.0 and +0.0 compare equal in both.
* Weights are computed in double from the float32 scores and cast once to float.
"""

from __future__ import annotations

from moe_onnx.custom_ops.gating import SOFTPLUS_EXP_LIMIT

from .builder import FLOAT, Body, Specialisation

DOUBLE = 11  # TensorProto.DOUBLE
FLOAT16 = 10  # TensorProto.FLOAT16
SOFTMAX, SIGMOID, SQRT_SOFTPLUS = 0, 1, 2


def shape_rules(b: Body, node: Specialisation):
    """``gate(value)``: ``value`` once the op's shape rules hold (dims symbolic when lowering);
    otherwise the run fails at the check naming the rule. The bodies gate the logits, which
    every score depends on, and the shapes the outputs are built from, so nothing runs on
    shapes the kernel refuses (a Range of k * n slots with k > E, say)."""
    return b.shape_gate()


def scores(b: Body, wide: str, norm_type: int) -> str:
    """``[R, E]`` float: softmax / sigmoid / sqrt(softplus) of double ``wide [R, E]`` rows."""
    one = b.scalar(1.0, "float64")
    if norm_type == SOFTMAX:
        shifted = b.Sub(wide, b.ReduceMax(wide, b.ints([1]), keepdims=1))
        exps = b.Exp(shifted)
        return b.Cast(b.Div(exps, b.ReduceSum(exps, b.ints([1]), keepdims=1)), to=FLOAT)
    if norm_type == SIGMOID:
        return b.Cast(b.Div(one, b.Add(one, b.Exp(b.Neg(wide)))), to=FLOAT)
    # sqrt(max(x, 0) + log1p(exp(-|x|))), log1p(u) = u when 1 + u == 1, else log(1 + u) * u / ((1 + u) - 1)
    # (Goldberg's formula: as accurate as log1p, which ONNX lacks)
    small = b.Exp(b.Neg(b.Abs(wide)))
    shifted = b.Add(one, small)
    log1p = b.Where(b.Equal(shifted, one), small, b.Div(b.Mul(b.Log(shifted), small), b.Sub(shifted, one)))
    root = b.Sqrt(b.Add(b.Max(wide, b.scalar(0.0, "float64")), log1p))
    # the NPU's float32 Exp overflows above the limit: its score is inf there (SPEC-layer 1.14 (b))
    overflow = b.Greater(wide, b.scalar(SOFTPLUS_EXP_LIMIT, "float64"))
    return b.Cast(b.Where(overflow, b.scalar(float("inf"), "float64"), root), to=FLOAT)


def ranked(b: Body, values: str) -> str:
    """float ``values`` with NaN replaced by -inf (how the rankings see them)."""
    return b.Where(b.IsNaN(values), b.scalar(float("-inf"), "float32"), values)


def best(b: Body, values: str, k: int, axis: int = 1) -> str:
    """int64 indices of the ``k`` largest ``values`` along ``axis``, best first, ties lower index."""
    _, index = b.TopK(values, b.ints([k]), axis=axis, largest=1, sorted=1, outputs=2)
    return index


def take_along_rows(b: Body, data: str, index: str) -> str:
    """``out[r, j] = data[r, index[r, j]]`` for 2-D ``data`` and int64 ``index [R, k]``, as a
    Gather from the flattened data (onnx.reference's GatherElements mis-shapes an index wider
    than the data, and its GatherND fails on zero rows)."""
    width = b.Shape(data, start=1)
    offsets = b.Unsqueeze(b.Mul(b.arange(b.Shape(data, end=1)), width), b.ints([1]))
    flat = b.Reshape(data, b.Unsqueeze(b.Size(data), b.ints([0])))
    return b.Gather(flat, b.Add(index, offsets), axis=0)


def weights(b: Body, scores: str, chosen: str, normalise: bool, scale: float, eps: float, dtype: str) -> str:
    """``[R, k]`` of ``dtype``: ``scores[r, chosen]`` (``/ (sum + eps)``) ``* scale``, in double,
    cast once to float, then to ``dtype``."""
    w = b.Cast(take_along_rows(b, scores, chosen), to=DOUBLE)
    if normalise:
        w = b.Div(w, b.Add(b.ReduceSum(w, b.ints([1]), keepdims=1), b.scalar(eps, "float64")))
    return b.narrow(b.Cast(b.Mul(w, b.scalar(scale, "float64")), to=FLOAT), dtype)
