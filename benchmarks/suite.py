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

import ctypes
import functools
import json
import math
import os
import threading
import time
from contextlib import contextmanager
from typing import Any

import ml_dtypes
import numpy as np
import onnxruntime as ort

import moe_onnx
from moe_onnx.builders import single_node_model
from moe_onnx.custom_ops import TensorInfo, buffers
from moe_onnx.custom_ops.dtypes import numpy_dtype
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
from moe_onnx.errors import UserError
from moe_onnx.runtime import pyops
from moe_onnx.runtime.ort_session import from_ort, to_ort

from .harness import Case, copy_floor, interleaved_seconds, median_seconds
from .presets import ALL_PRESETS, DEFAULT_PRESETS, PRESETS, SEED, Preset
from .torch_ops import torch_callable

__all__ = ["PRESETS", "DEFAULT_PRESETS", "Preset", "category", "moe_cases", "seed_cases", "run", "command"]


#: the stock path turns outputs into Python lists (~36 bytes an element, and a conversion
#: buffer): cases with more output elements skip it (40M: ~1.8 GB at the peak)
STOCK_MAX_ELEMENTS = 40_000_000
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


def seed_cases(p: Preset = SEED) -> list[Case]:
    """The seed's call at ``p``'s rows and hidden size (the cases are counted at a small one)."""
    rng = np.random.default_rng(0)
    counts = rng.multinomial(p.tokens, np.full(256, 1 / 256)).reshape(16, 16).astype(np.int32)
    inputs: dict[str, np.ndarray | None] = {
        "tokens": rng.integers(-10, 20, (p.tokens, p.hidden), dtype=np.int8),
        "expert_token_num_per_rank": counts,
        "per_token_scales": rng.standard_normal(p.tokens).astype(np.float32),
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
    """Peak resident memory added while ``fn`` runs, above what the process holds before
    (its allocations taken from the OS: :func:`_allocations_from_the_os`).

    Linux's high-water mark after a reset (``/proc/self/clear_refs``) where the kernel allows
    the reset; elsewhere (no /proc, or the reset refused) the most of the resident size
    sampled every 0.2 ms by a thread, which may miss a spike shorter than that."""
    with _allocations_from_the_os():
        return _peak_bytes(fn)


def _peak_bytes(fn) -> int:
    base = _resident("VmRSS:")
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the high-water mark to the current RSS
        reset = _resident("VmHWM:") <= base + (1 << 20)
    except OSError:
        reset = False
    if reset:
        fn()
        return max(0, _resident("VmHWM:") - base)
    highest = [base]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            highest[0] = max(highest[0], _resident("VmRSS:"))
            time.sleep(0.0002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        fn()
    finally:
        done.set()
        sampler.join()
    return max(0, max(highest[0], _resident("VmRSS:")) - base)


@contextmanager
def _allocations_from_the_os():
    """While measuring, glibc gives freed heap memory back first (``malloc_trim``) and takes
    every block over 64 KiB from the OS (``mallopt(M_MMAP_THRESHOLD)``): otherwise a call's
    outputs reuse heap pages that earlier cases freed but the process still holds, and its
    resident size never grows (the bench's peak column read 0.00). Elsewhere a no-op."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, 64 << 10)
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        yield
        return
    try:
        yield
    finally:
        libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20)  # glibc's own ceiling for the threshold


#: mallopt's parameter number of the mmap threshold (glibc's malloc.h)
_M_MMAP_THRESHOLD = -3


def _resident(key: str) -> int:
    """A size from /proc/self/status in bytes, or the peak from getrusage without /proc."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def lowered_callable(model, feeds: dict):
    """A stock onnxruntime session on the inline-lowered model: returns a call running it.
    Default options but the log level: onnxruntime's warnings about the constants a body
    leaves unused would fill the bench's output."""
    lowered = moe_onnx.lower(model, inline=True)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(lowered.SerializeToString(), options, providers=["CPUExecutionProvider"])
    values = {k: to_ort(v) for k, v in feeds.items()}
    names = [o.name for o in session.get_outputs()]
    return lambda: session.run_with_ort_values(names, values)


def _close(got: np.ndarray, want: np.ndarray, rtol: float, atol: float) -> bool:
    """``np.allclose`` of the two as float32, a block of rows at a time: on whole outputs its
    temporaries reach five float32 copies (2.4 GB for the seed's 117 MB int8 output)."""
    if got.shape != want.shape:
        return False
    got, want = got.reshape(got.shape[0] if got.ndim else 1, -1), want.reshape(want.shape[0] if want.ndim else 1, -1)
    rows = max(1, (16 << 20) // max(1, got.shape[1] * 4))  # 16 MB of float32 per block
    return all(
        np.allclose(got[i : i + rows].astype(np.float32), want[i : i + rows].astype(np.float32), rtol=rtol, atol=atol)
        for i in range(0, got.shape[0], rows)
    )


def _bits(array: np.ndarray) -> np.ndarray:
    """The bytes of ``array`` as a flat uint8 view (a copy only when it is not contiguous)."""
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8)


def _same_outputs(lowered_values, kernel_result, exact: bool) -> bool:
    """Do the lowered model's outputs equal the kernel's (bits, or float tolerance for sums)?"""
    kernel_outputs = [np.asarray(y) for y in kernel_result if y is not None]
    for value, want in zip(lowered_values, kernel_outputs):
        got = from_ort(value)
        if got.dtype != want.dtype or got.shape != want.shape:
            return False
        if exact or got.dtype.kind in "iub":
            if not np.array_equal(_bits(got), _bits(want)):
                return False
        elif not _close(got, want, rtol=1e-2, atol=1e-2):
            return False
    return True


def _outputs(case: Case) -> list[tuple[int, int]]:
    """(elements, bytes per element) of each output of ``case``, from the op's shape
    inference (nothing is run; the cases' shapes are all concrete)."""
    infos = [None if x is None else TensorInfo.of(x) for x in case.inputs.values()]
    found = []
    for info in case.op.signature(infos, case.attrs).outputs.values():
        dims = [d for d in info.shape or () if isinstance(d, int)]
        if info.dtype is not None and info.shape is not None and len(dims) == len(info.shape):
            found.append((math.prod(dims), numpy_dtype(info.dtype).itemsize))
    return found


def output_bytes(case: Case) -> int:
    """Bytes of the case's outputs (:func:`_outputs`)."""
    return sum(elements * size for elements, size in _outputs(case))


#: a case's peak, in multiples of its input + output bytes, on top of what the process holds
#: (measured without the stock path: 4.5x for the seed's case, up to 11x for the mixtral unpermute grad,
#: whose lowered model computes in float32)
PEAK_PER_IO_BYTE = 12
#: and per output element of the stock path: a Python list (an 8-byte pointer and a 28-byte
#: int or float object) and the extensions' 8-byte conversion buffer
STOCK_BYTES_PER_ELEMENT = 44


def output_elements(case: Case) -> int:
    return sum(elements for elements, _ in _outputs(case))


def estimated_peak_bytes(case: Case, stock: bool = True) -> int:
    """What measuring ``case`` adds to the process's memory at its peak, estimated from its
    sizes before anything runs (the guard against ``MOE_ONNX_MAX_BYTES``)."""
    read = sum(x.nbytes for x in case.inputs.values() if x is not None)
    elements = output_elements(case)
    lists = STOCK_BYTES_PER_ELEMENT * elements if stock and elements <= STOCK_MAX_ELEMENTS else 0
    return PEAK_PER_IO_BYTE * (read + output_bytes(case)) + lists


def measure_case(case: Case, repeats: int = 5, stock: bool = True, between=lambda: None) -> dict:
    """One row of the table. ``between()`` runs between any two timed calls (where an
    interrupt may stop the case, see :func:`run`)."""
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
    seconds, ratios = interleaved_seconds(paths, repeats, between=between)
    for name in paths:
        row[f"{name}_s"] = seconds[name]
        if name != "floor":
            row[f"{name}_x_floor"] = ratios[name]
    between()
    # the memory a call needs, its outputs and work buffers: no recycled buffer to reuse (in
    # steady state a session's outputs reuse the previous call's memory and the peak is ~0)
    with buffers.no_reuse():
        row["session_peak_bytes"] = peak_bytes(run)
    row["torch_matches"] = None if eager is None else _same_math(eager(), case.call_kernel())
    row["lowered_matches"] = _same_outputs(run_lowered(), case.call_kernel(), row["category"] == "movement")
    elements = sum(np.asarray(y).size for y in case.call_kernel() if y is not None)
    if stock and elements <= STOCK_MAX_ELEMENTS:
        between()
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
    return _close(first.numpy(), np.asarray(kernel_result[0]), rtol=2e-2, atol=1e-2)


# --- the run -----------------------------------------------------------------------------


def presets_for(shape: str | None) -> list[str]:
    """The presets ``--shape`` names: one, "all" (every one but tiny), or the default ones."""
    if shape == "all":
        return list(ALL_PRESETS)
    return [shape] if shape else list(DEFAULT_PRESETS)


def cases_of(name: str, small: bool = False) -> list[Case]:
    """Every case of preset ``name``; ``small``: the same cases at a small T and H (to count
    and name them without building the real inputs)."""
    p = PRESETS[name]
    if small:
        p = Preset(p.name, 256 if name == "seed" else 16, 8, p.experts, p.top_k, p.about)
    return seed_cases(p) if name == "seed" else moe_cases(p)


@functools.cache
def case_names(name: str) -> tuple[str, ...]:
    """The op type of each case of preset ``name``, in order (built small, once)."""
    return tuple(c.op_type for c in cases_of(name, small=True))


def bench_ops() -> list[str]:
    """The op types a preset has a case of (every case a preset builds, tiny builds too)."""
    return sorted(set(case_names("tiny")) | set(case_names("seed")))


def plan(op: str | None, shape: str | None) -> list[tuple[str, int]]:
    """(preset, cases of ``op`` in it) of the run, checked before anything is measured."""
    ops = bench_ops()
    if op is not None and op not in ops:
        raise UserError(f"--op {op!r} has no benchmark case; the ops with one: {', '.join(ops)}")
    counts = [(name, sum(op in (None, c) for c in case_names(name))) for name in presets_for(shape)]
    if not any(n for _, n in counts):
        raise UserError(f"preset {shape} has no case of {op}")
    return [(name, n) for name, n in counts if n]


def _work(name: str) -> int:
    """A preset's cost per case, in rows moved times hidden size (for the time estimate)."""
    p = PRESETS[name]
    return p.tokens * p.top_k * p.hidden


def _minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds // 60:.0f} min {seconds % 60:02.0f} s"


def run(
    op: str | None = None,
    preset: str | None = None,
    repeats: int = 5,
    stock: bool = True,
    echo=print,
    rows: list[dict] | None = None,
    skipped: list[str] | None = None,
) -> list[dict]:
    """Measure every case of the run (:func:`plan`), appending each row to ``rows`` as it is
    done (so an interrupted run keeps the finished ones) and printing a progress line with an
    estimate of the time left.

    SIGINT and SIGTERM are deferred while a case runs (its PyOp session calls back into
    Python from C++, where an exception raised by the signal would abort the process) and
    taken between two timed calls, as KeyboardInterrupt. A case whose estimated peak
    (:func:`estimated_peak_bytes`) is over ``MOE_ONNX_MAX_BYTES`` is skipped, with a line.
    """
    from moe_onnx.custom_ops.opdef import LIMIT_VARIABLE, max_bytes
    from moe_onnx.interrupts import deferred

    rows = [] if rows is None else rows
    skipped = [] if skipped is None else skipped
    steps = plan(op, preset)
    total = sum(n for _, n in steps)
    total_work = sum(n * _work(name) for name, n in steps)
    done = done_work = 0
    limit = max_bytes()
    start = time.perf_counter()
    for name, _ in steps:
        cases = [c for c in cases_of(name) if op is None or c.op_type == op]
        while cases:
            case = cases.pop(0)  # the inputs go once no later case shares them
            done += 1
            label = f"[{done}/{total}] {case.op_type} {case.preset}"
            need = estimated_peak_bytes(case, stock)
            if need > limit:
                skipped.append(f"{case.op_type} {case.preset} (needs ~{need / 2**30:.1f} GB)")
                echo(f"{label}: skipped, needs ~{need / 2**30:.1f} GB > {LIMIT_VARIABLE} = {limit / 2**30:.1f} GB")
                done_work += _work(name)
                continue
            echo(f"{label} ...", end="", flush=True)
            with deferred() as interrupts:
                row = measure_case(case, repeats, stock, between=interrupts.check)
            rows.append(row)
            done_work += _work(name)
            elapsed = time.perf_counter() - start
            left = elapsed * (total_work - done_work) / done_work if done < total else 0.0
            echo(
                f" kernel {row['kernel_x_floor']:.2f}x, session {row['session_x_floor']:.2f}x, "
                f"pyop session {row['pyop_x_floor']:.2f}x, lowered {row['lowered_x_floor']:.2f}x floor"
                f" | {_minutes(elapsed)} so far" + (f", ~{_minutes(left)} left" if done < total else ""),
                flush=True,
            )
    return rows


def check_plot_path(path: str) -> None:
    """matplotlib is installed and can write ``path``'s format (checked before the run)."""
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise UserError("--plot needs matplotlib: pip install matplotlib (or the [bench] extra)") from exc
    suffix = path.rsplit(".", 1)[-1].lower() if "." in path else ""
    formats = Figure().canvas.get_supported_filetypes()
    if suffix not in formats:
        raise UserError(f"--plot {path}: give a file ending in one of .{', .'.join(sorted(formats))}")


def command(
    op: str | None,
    shape: str | None,
    repeats: int,
    stock: bool,
    json_path: str | None,
    markdown_path: str | None,
    plot_path: str | None,
    echo=print,
) -> int:
    """``moe-onnx bench``: check every option and output, run, write the table. Interrupted,
    it writes the rows finished so far, then lets the KeyboardInterrupt end the command."""
    from moe_onnx.interrupts import held
    from moe_onnx.ranks.rank_files import check_output_file, make_parent

    for path, option in ((json_path, "--json"), (markdown_path, "--markdown"), (plot_path, "--plot")):
        if path:
            check_output_file(path, option)
    if plot_path:
        check_plot_path(plot_path)
    steps = plan(op, shape)
    echo(
        f"bench: {sum(n for _, n in steps)} case(s) in {', '.join(name for name, _ in steps)}, "
        f"{repeats} round(s) each{'' if stock else ', no stock path'}",
        flush=True,
    )
    rows: list[dict] = []
    skipped: list[str] = []
    try:
        run(op, shape, repeats, stock, echo=echo, rows=rows, skipped=skipped)
    except KeyboardInterrupt:
        with held():
            _write(rows, json_path, markdown_path, plot_path, make_parent, echo, partial=True)
        raise
    _write(rows, json_path, markdown_path, plot_path, make_parent, echo, partial=False)
    if skipped:
        echo(f"skipped {len(skipped)} case(s) over MOE_ONNX_MAX_BYTES: {'; '.join(skipped)}")
    return 0


def _write(rows, json_path, markdown_path, plot_path, make_parent, echo, partial: bool) -> None:
    if partial:
        echo(f"\ninterrupted: {len(rows)} row(s) finished" + (", written" if rows else ""), flush=True)
    if not rows:
        return
    table = markdown(rows)
    echo("\n" + table, flush=True)
    for path in (json_path, markdown_path, plot_path):
        if path:
            make_parent(path)
    if json_path:
        save_json(rows, json_path)
    if markdown_path:
        with open(markdown_path, "w") as f:
            f.write(table + "\n")
    if plot_path:
        plot(rows, plot_path)


def _fmt(row: dict, key: str) -> str:
    value = row.get(f"{key}_s")
    return "-" if value is None else f"{_ms(value)} ({row[f'{key}_x_floor']:.2f}x)"


def _ms(seconds: float) -> str:
    """Milliseconds to 3 significant digits: a tiny case's 0.004 ms is not 0.0."""
    return f"{seconds * 1e3:.3g}"


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
            f"{(r['bytes_read'] + r['bytes_written']) / 1e6:.3g} | {_ms(r['floor_s'])} | "
            f"{_fmt(r, 'kernel')} | {_fmt(r, 'kernel_fresh')} | {_fmt(r, 'session')} | "
            f"{_fmt(r, 'pyop')} | "
            f"{_fmt(r, 'stock')} | {_fmt(r, 'torch')} | {_fmt(r, 'lowered')}"
            f"{' (differs!)' if r.get('lowered_matches') is False else ''} | "
            f"{speedup} | {r['peak_x_io']:.2f} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    """Achieved GB/s (bytes read + written over time) of each path, next to the floor's."""
    figure = plot_figure(rows)
    figure.savefig(path, dpi=110, bbox_inches="tight")  # the legend below the axes, never over the bars


def plot_figure(rows: list[dict]):
    """The figure of :func:`plot`: one group of bars per row, labelled with the op's name, the
    preset and what the op does; the legend, in words, below the axes."""
    from matplotlib.figure import Figure

    labels = [f"{r['op']}\n{r['preset']}, {CATEGORY_WORDS.get(r['category'], r['category'])}" for r in rows]
    series = [
        ("the floor: a numpy copy of the same bytes", "floor_s"),
        ("the bare numpy kernel", "kernel_s"),
        ("moe_onnx.InferenceSession (split executor)", "session_s"),
        ("moe_onnx.InferenceSession, pyop executor", "pyop_s"),
        ("PyTorch eager", "torch_s"),
        ("stock onnxruntime on the lowered model", "lowered_s"),
    ]
    y = np.arange(len(rows))
    fig = Figure(figsize=(11, 0.7 * len(rows) + 2.5))
    ax = fig.subplots()
    height = 0.8 / len(series)
    for i, (name, key) in enumerate(series):
        gbps = [(r["bytes_read"] + r["bytes_written"]) / r[key] / 1e9 if r.get(key) else 0 for r in rows]
        ax.barh(y + i * height, gbps, height, label=name)
    ax.set_yticks(y + 0.4 - height / 2, labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("achieved GB/s: bytes read + written by the op, over its time (higher is faster)")
    ax.set_title("moe-onnx: each op's speed beside the copy floor")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.8 / max(len(rows), 1) - 0.04), ncol=2, fontsize=8)
    return fig


#: the plot's words for a row's category
CATEGORY_WORDS = {
    "movement": "moves rows",
    "arithmetic": "adds rows",
    "gating": "gating",
    "matmul": "matrix products",
}


def save_json(rows: list[dict], path: str) -> None:
    """The rows as JSON, written under a temporary name and renamed (an interrupt leaves the
    previous file or the new one, never half of one)."""
    partial = f"{path}.partial"
    with open(partial, "w") as f:
        json.dump(rows, f, indent=1)
    os.replace(partial, path)
