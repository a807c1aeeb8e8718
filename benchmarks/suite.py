"""``moe-onnx bench``: every op at realistic presets, against the memory floor, side by side.

For each case, in one run: the floor (a numpy copy of (bytes read + bytes written) / 2 into a
preallocated buffer), the bare kernel (writing into recycled output memory as the session
calls it, and returning fresh arrays), the op through ``moe_onnx.InferenceSession``, the op
through the stock onnxruntime-extensions output path (lists), PyTorch eager (Megatron-style,
when torch is installed and a counterpart exists), and the peak memory of a session call.
The paths run in turn, round after round (a warm-up round first); times are medians and each
ratio to the floor is the median of its per-round ratios. The stock path, ~100x slower, runs
once after them. "stock onnxruntime, lowered" is a plain onnxruntime session (default options,
no moe-onnx in the loop) on the one-node model lowered with ``moe_onnx.lower(inline=True)``.
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np
import onnxruntime as ort

import moe_onnx
from moe_onnx import pyops
from moe_onnx.builders import single_node_model
from moe_onnx.custom_ops.grouped_matmul import GROUPED_MATMUL
from moe_onnx.custom_ops.moe_finalize_routing_v2 import MOE_FINALIZE_ROUTING_V2
from moe_onnx.custom_ops.moe_gating_top_k import MOE_GATING_TOP_K
from moe_onnx.custom_ops.moe_gating_top_k_backward import MOE_GATING_TOP_K_BACKWARD
from moe_onnx.custom_ops.moe_gating_top_k_softmax import MOE_GATING_TOP_K_SOFTMAX
from moe_onnx.custom_ops.moe_init_routing_v2_grad import MOE_INIT_ROUTING_V2_GRAD
from moe_onnx.custom_ops.moe_token_permute_grad import MOE_TOKEN_PERMUTE_GRAD
from moe_onnx.custom_ops.moe_token_permute_with_routing_map_grad import MOE_TOKEN_PERMUTE_WITH_ROUTING_MAP_GRAD
from moe_onnx.custom_ops.moe_token_unpermute import MOE_TOKEN_UNPERMUTE
from moe_onnx.custom_ops.moe_token_unpermute_with_routing_map import MOE_TOKEN_UNPERMUTE_WITH_ROUTING_MAP
from moe_onnx.custom_ops.swi_glu import SWI_GLU
from moe_onnx.ort_session import from_ort, to_ort

from .harness import Case, copy_floor, interleaved_seconds, median_seconds
from .torch_ops import torch_callable


@dataclass(frozen=True)
class Preset:
    name: str
    tokens: int  # T
    hidden: int  # H
    experts: int  # E
    top_k: int  # K


PRESETS = {
    "seed": None,  # the seed's rerouting call: 16 ranks x 16 experts, A = 16384, H = 7168, int8
    "deepseek-v3": Preset("deepseek-v3", 4096, 7168, 256, 8),
    "qwen3-235b": Preset("qwen3-235b", 4096, 4096, 128, 8),
    "mixtral": Preset("mixtral", 4096, 4096, 8, 2),
    "tiny": Preset("tiny", 64, 32, 8, 2),  # for smoke tests; not run by default
}
DEFAULT_PRESETS = ("seed", "deepseek-v3", "qwen3-235b", "mixtral")
#: the stock path turns outputs into Python lists (~36 bytes an element): bigger ones are not run
STOCK_MAX_ELEMENTS = 150_000_000
#: ops that add rows (the K copies of a token, probs-weighted or not); the rest only move bytes
SUMS = {
    MOE_INIT_ROUTING_V2_GRAD,
    MOE_TOKEN_PERMUTE_WITH_ROUTING_MAP_GRAD,
    MOE_TOKEN_UNPERMUTE_WITH_ROUTING_MAP,
    MOE_TOKEN_PERMUTE_GRAD,
    MOE_TOKEN_UNPERMUTE,
}
#: the gating ops: scores (exp per logit) and a top-k per token
GATING = {MOE_GATING_TOP_K_SOFTMAX, MOE_GATING_TOP_K, MOE_GATING_TOP_K_BACKWARD}
SUMS |= {MOE_FINALIZE_ROUTING_V2, SWI_GLU}
#: products: their target is against torch's per-group mm loop (the torch column), not the floor
MATMULS = {GROUPED_MATMUL}


def category(case: Case) -> str:
    """ "arithmetic" (target <= 2.5x the floor), "movement" (<= 1.3x), "gating" (<= 3x) or
    "matmul" (against torch)."""
    if case.op in GATING:
        return "gating"
    if case.op in MATMULS:
        return "matmul"
    grad_with_probs = case.op_type.endswith("Grad") and case.inputs.get("probs") is not None
    return "arithmetic" if case.op in SUMS or grad_with_probs else "movement"


@contextmanager
def stock_output_path():
    """Outputs cross as Python lists, as the stock extensions hook sends them
    (``ndarray.flatten().tolist()``), around the same kernels and checks."""

    def stock(k_id, feed, attributes):
        packed = pyops.invoke(k_id, feed, attributes)
        return tuple(v.flatten().tolist() if isinstance(v, np.ndarray) else v for v in packed)

    with pyops.hook(stock):
        yield


def seed_cases() -> list[Case]:
    rng = np.random.default_rng(0)
    counts = rng.multinomial(16384, np.full(256, 1 / 256)).reshape(16, 16).astype(np.int32)
    inputs: dict[str, np.ndarray | None] = {
        "tokens": rng.integers(-10, 20, (16384, 7168), dtype=np.int8),
        "expert_token_num_per_rank": counts,
        "per_token_scales": rng.standard_normal(16384).astype(np.float32),
        "expert_topk_weight": None,
    }
    return [
        Case(
            "MoeReRoutingV2",
            "seed",
            inputs,
            outputs=["permute_tokens", "permute_per_token_scales", "permute_token_idx", "expert_token_num", ""],
        )
    ]


def re_routing_case(p: Preset, rng) -> Case:
    """After an AllToAll on one of N = min(16, E) ranks: ~T*K rows for E/N local experts."""
    ranks = min(16, p.experts)
    counts = rng.multinomial(p.tokens * p.top_k, np.full(p.experts, 1 / p.experts))
    counts = counts.reshape(ranks, p.experts // ranks).astype(np.int32)
    tokens = rng.standard_normal((int(counts.sum()), p.hidden), np.float32).astype(ml_dtypes.bfloat16)
    return Case(
        "MoeReRoutingV2",
        p.name,
        {"tokens": tokens, "expert_token_num_per_rank": counts},
        outputs=["permute_tokens", "permute_per_token_scales", "permute_token_idx", "expert_token_num", ""],
    )


def moe_cases(p: Preset) -> list[Case]:
    from . import bench_dispatch, bench_gating, bench_init_routing, bench_layer, bench_routing_map

    rng = np.random.default_rng(0)
    cases = [re_routing_case(p, rng)]
    cases += [
        c
        for c in bench_init_routing.cases_for(p.name, p.tokens, p.hidden, p.experts, p.top_k)
        if "dropless" in c.preset
    ]
    for mode in ("probs", "plain"):
        for case in bench_routing_map.cases_for(p.name, mode, p.tokens, p.hidden, p.experts, p.top_k):
            if mode == "probs" or case.op_type.endswith("Grad"):
                cases.append(case)
    cases += bench_dispatch.cases_for(p.name, p.tokens, p.hidden, p.experts, p.top_k)
    cases += bench_gating.cases_for(p.name, p.tokens, p.experts, p.top_k)
    cases += bench_layer.cases_for(p.name, p.tokens, p.hidden, p.experts, p.top_k, bench_layer.PRESETS[p.name][-1])
    return cases


def peak_bytes(fn) -> int:
    """Peak resident memory added while ``fn`` runs (Linux: VmHWM after a reset)."""

    def status(key: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the high-water mark to the current RSS
    base = status("VmRSS:")
    fn()
    return status("VmHWM:") - base


def lowered_callable(model, feeds: dict):
    """A stock onnxruntime session on the inline-lowered model: returns a call running it."""
    lowered = moe_onnx.lower(model, inline=True)
    session = ort.InferenceSession(lowered.SerializeToString(), providers=["CPUExecutionProvider"])
    values = {k: to_ort(v) for k, v in feeds.items()}
    names = [o.name for o in session.get_outputs()]
    return lambda: session.run_with_ort_values(names, values)


def _same_outputs(lowered_values, kernel_result, exact: bool) -> bool:
    """Do the lowered model's outputs equal the kernel's (bits, or float tolerance for sums)?"""
    kernel_outputs = [np.asarray(y) for y in kernel_result if y is not None]
    for value, want in zip(lowered_values, kernel_outputs):
        got = from_ort(value)
        if got.dtype != want.dtype or got.shape != want.shape:
            return False
        if exact or got.dtype.kind in "iub":
            if got.tobytes() != want.tobytes():
                return False
        elif not np.allclose(got.astype(np.float32), want.astype(np.float32), rtol=1e-2, atol=1e-2):
            return False
    return True


def measure_case(case: Case, repeats: int = 5, stock: bool = True) -> dict:
    read, written = case.io_bytes()
    model = single_node_model(case.op_type, case.inputs, case.attrs, case.outputs)
    session = moe_onnx.InferenceSession(model)
    pyop_session = moe_onnx.InferenceSession(model, executor="pyop")
    feeds = {k: v for k, v in case.inputs.items() if v is not None}
    row: dict[str, Any] = {
        "op": case.op_type,
        "preset": case.preset,
        "category": category(case),
        "bytes_read": read,
        "bytes_written": written,
    }
    run = lambda: session.run(None, feeds)  # noqa: E731
    run_pyop = lambda: pyop_session.run(None, feeds)  # noqa: E731
    eager = torch_callable(case)
    run_lowered = lowered_callable(model, feeds)
    paths = {
        "floor": copy_floor((read + written) // 2),
        "kernel": case.call_kernel_recycled,
        "kernel_fresh": case.call_kernel,
        "session": run,
        "pyop": run_pyop,
        "lowered": run_lowered,
    }
    if eager is not None:
        paths["torch"] = eager
    row["torch_s"] = None  # without torch, or without a counterpart
    seconds, ratios = interleaved_seconds(paths, repeats)
    for name in paths:
        row[f"{name}_s"] = seconds[name]
        if name != "floor":
            row[f"{name}_x_floor"] = ratios[name]
    row["session_peak_bytes"] = peak_bytes(run)
    row["torch_matches"] = None if eager is None else _same_math(eager(), case.call_kernel())
    row["lowered_matches"] = _same_outputs(run_lowered(), case.call_kernel(), row["category"] == "movement")
    elements = sum(np.asarray(y).size for y in case.call_kernel() if y is not None)
    if stock and elements <= STOCK_MAX_ELEMENTS:
        with stock_output_path():
            row["stock_s"] = median_seconds(run_pyop, repeats=1, warmup=0)
        row["stock_x_floor"] = row["stock_s"] / row["floor_s"]
    row["peak_x_io"] = row["session_peak_bytes"] / (read + written)
    return row


def _same_math(torch_result, kernel_result) -> bool:
    """Does the torch counterpart compute what the kernel does (first output, float tolerance)?"""
    first = torch_result[0] if isinstance(torch_result, tuple) else torch_result
    if first.dtype.is_floating_point:
        first = first.float()
    want = np.asarray(kernel_result[0]).astype(np.float32)
    return bool(np.allclose(first.numpy().astype(np.float32), want, rtol=2e-2, atol=1e-2))


def run(
    op: str | None = None, preset: str | None = None, repeats: int = 5, stock: bool = True, echo=print
) -> list[dict]:
    presets = [preset] if preset else list(DEFAULT_PRESETS)
    rows = []
    start = time.perf_counter()
    for name in presets:
        p = PRESETS[name]
        cases = seed_cases() if p is None else moe_cases(p)
        cases = [c for c in cases if op is None or c.op_type == op]
        for i, case in enumerate(cases, 1):
            echo(f"[{name} {i}/{len(cases)}] {case.op_type} {case.preset} ...", end="", flush=True)
            row = measure_case(case, repeats, stock)
            rows.append(row)
            echo(
                f" kernel {row['kernel_x_floor']:.2f}x, session {row['session_x_floor']:.2f}x, "
                f"pyop session {row['pyop_x_floor']:.2f}x, lowered {row['lowered_x_floor']:.2f}x floor"
                f" ({time.perf_counter() - start:.0f} s)",
                flush=True,
            )
    return rows


def _fmt(row: dict, key: str) -> str:
    value = row.get(f"{key}_s")
    return "-" if value is None else f"{value * 1e3:.1f} ({row[f'{key}_x_floor']:.2f}x)"


def markdown(rows: list[dict]) -> str:
    lines = [
        "| op | preset | kind | MB moved | floor ms | kernel ms (x) | kernel, fresh outputs ms (x) "
        "| session ms (x) | pyop session ms (x) | stock hook ms (x) | torch ms (x) "
        "| stock onnxruntime, lowered ms (x) | session / stock | peak / io |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        speedup = f"{r['stock_s'] / r['session_s']:.0f}x" if r.get("stock_s") else "-"
        if r.get("torch_matches") is False:
            speedup += " (torch differs!)"
        lines.append(
            f"| {r['op']} | {r['preset']} | {r['category']} | "
            f"{(r['bytes_read'] + r['bytes_written']) / 1e6:.0f} | {r['floor_s'] * 1e3:.1f} | "
            f"{_fmt(r, 'kernel')} | {_fmt(r, 'kernel_fresh')} | {_fmt(r, 'session')} | "
            f"{_fmt(r, 'pyop')} | "
            f"{_fmt(r, 'stock')} | {_fmt(r, 'torch')} | {_fmt(r, 'lowered')}"
            f"{' (differs!)' if r.get('lowered_matches') is False else ''} | "
            f"{speedup} | {r['peak_x_io']:.2f} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    """Achieved GB/s (bytes read + written over time) of each path, next to the floor's."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['op'].replace('MoeToken', '').replace('WithRoutingMap', 'RM')} | {r['preset']}" for r in rows]
    series = [
        ("floor", "floor_s"),
        ("kernel", "kernel_s"),
        ("session", "session_s"),
        ("pyop session", "pyop_s"),
        ("torch", "torch_s"),
        ("stock onnxruntime, lowered", "lowered_s"),
    ]
    y = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(rows) + 1.5))
    height = 0.8 / len(series)
    for i, (name, key) in enumerate(series):
        gbps = [(r["bytes_read"] + r["bytes_written"]) / r[key] / 1e9 if r.get(key) else 0 for r in rows]
        ax.barh(y + i * height, gbps, height, label=name)
    ax.set_yticks(y + 0.4 - height / 2, labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("GB/s (bytes read + written / time)")
    ax.legend(loc="lower right")
    ax.set_title("moe-onnx: achieved bandwidth vs the copy floor")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def save_json(rows: list[dict], path: str) -> None:
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)
