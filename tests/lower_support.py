"""Helpers of the lowering tests: a worker that runs lowered models without moe_onnx, and the
comparisons of its outputs with the kernels'.

Tolerances (issue 15): data movement, index and count outputs must be bit-exact. A float32 sum
may differ from the kernel's by at most ``1e-6 * sum|terms|`` (the order of float32 additions
is the runtime's); a float16/bfloat16 sum by that plus one unit in the last place of the
result, since a float32 difference that small may still flip the final rounding. The bound
``sum|terms|`` is the kernel's own output on the absolute values of the inputs.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

import ml_dtypes
import numpy as np
import onnx

import moe_onnx
from moe_onnx.custom_ops import OPS

from .support import assert_same_bits, node_model

RUNNER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lowered_runner.py")
RUNTIMES = ("onnxruntime", "reference")
_ML_DTYPES = ("bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu")


def pack(array: np.ndarray) -> tuple[str, tuple, bytes]:
    array = np.ascontiguousarray(array)
    return str(array.dtype), array.shape, array.tobytes()


def unpack(packed: tuple[str, tuple, bytes]) -> np.ndarray:
    name, shape, data = packed
    dtype = np.dtype(getattr(ml_dtypes, name)) if name in _ML_DTYPES else np.dtype(name)
    return np.frombuffer(data, dtype).reshape(shape)


class LoweredRunner:
    """One worker process (``tests/lowered_runner.py``) for a batch of lowered models."""

    def __init__(self):
        self.process = subprocess.Popen(
            [sys.executable, RUNNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
        )

    def run(self, model: onnx.ModelProto, feeds: dict[str, np.ndarray], check: bool = True) -> dict:
        """``{"onnxruntime": outputs or error, "reference": ..., "checker": error or None}``."""
        packed = {k: pack(v) for k, v in feeds.items() if v is not None}
        request = {"model": model.SerializeToString(), "feeds": packed, "check": check}
        pickle.dump(request, self.process.stdin)
        self.process.stdin.flush()
        reply = pickle.load(self.process.stdout)
        assert "worker" not in reply, reply.get("worker")
        assert not reply.pop("moe_onnx_imported"), "the stock-runtime worker imported moe_onnx"
        for runtime in RUNTIMES:
            if not isinstance(reply[runtime], str):
                reply[runtime] = [unpack(y) for y in reply[runtime]]
        return reply

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=30)


def abs_inputs(inputs: dict[str, np.ndarray | None], names: tuple[str, ...]) -> dict[str, np.ndarray | None]:
    """``inputs`` with the float inputs ``names`` replaced by their absolute values."""
    return {k: (np.abs(v) if k in names and v is not None else v) for k, v in inputs.items()}


def ulp(values: np.ndarray) -> np.ndarray:
    """The spacing of ``values`` in their own dtype, as float64."""
    wide = np.abs(values.astype(np.float64))
    if values.dtype == ml_dtypes.bfloat16:
        exponent = np.floor(np.log2(np.maximum(wide, 2.0**-126)))
        return 2.0 ** (exponent - 7)
    if values.dtype == np.float16:
        return np.spacing(np.abs(values)).astype(np.float64)
    return np.spacing(np.abs(values.astype(np.float32))).astype(np.float64)


def assert_sum_close(got: np.ndarray, want: np.ndarray, bound: np.ndarray, message: str) -> None:
    """``|got - want| <= 1e-6 * bound`` (+ one ulp of ``want`` for float16/bfloat16)."""
    assert got.dtype == want.dtype and got.shape == want.shape, (
        f"{message}: {got.dtype}{got.shape} vs {want.dtype}{want.shape}"
    )
    diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
    allowed = 1e-6 * np.abs(bound.astype(np.float64))
    if want.dtype != np.float32:
        allowed = allowed + ulp(want)
    worst = np.argmax(diff - allowed) if diff.size else None
    assert diff.size == 0 or (diff <= allowed).all(), (
        f"{message}: |d| = {diff.flat[worst]} > {allowed.flat[worst]} at {np.unravel_index(worst, diff.shape)}"
    )


def check_lowered(
    runner: LoweredRunner,
    op_type: str,
    inputs: dict[str, np.ndarray | None],
    attrs: dict,
    outputs: list[str] | None = None,
    *,
    sums: dict[str, tuple[str, ...]] | None = None,
    inline: bool = False,
    opset: int = 21,
) -> onnx.ModelProto:
    """Lower a one-node model and check both stock runtimes against the kernel.

    Args:
        sums: output -> the inputs whose absolute values bound its terms; every other
            output must be bit-exact.
    Returns:
        the lowered model.
    """
    op = OPS[op_type]
    model = node_model(op_type, inputs, attrs, outputs, opset=opset)
    names = list(op.output_names) if outputs is None else outputs
    wanted = {o for o, name in zip(op.output_names, names) if name}
    want = op(*inputs.values(), wanted=wanted, **attrs)
    lowered = moe_onnx.lower(model, inline=inline)
    feeds = {k: v for k, v in inputs.items() if v is not None}
    reply = runner.run(lowered, feeds)
    assert reply["checker"] is None, reply["checker"]
    bounds = {}
    for output, terms in (sums or {}).items():
        if output in wanted:
            bounds[output] = op(*abs_inputs(inputs, terms).values(), wanted=wanted, **attrs)[
                op.output_names.index(output)
            ]
    for runtime in RUNTIMES:
        got = reply[runtime]
        assert not isinstance(got, str), f"{runtime} failed on the lowered {op_type}: {got}"
        expected = [(o, w) for o, w in zip(op.output_names, want) if o in wanted]
        assert len(got) == len(expected), f"{runtime}: {len(got)} outputs, expected {len(expected)}"
        for (output, w), g in zip(expected, got):
            message = f"{runtime}, {op_type} {output} (inline={inline}, attrs={attrs})"
            if output in bounds:
                assert_sum_close(g, w, bounds[output], message)
            else:
                assert_same_bits(g, w, message)
    return lowered
