"""Side-by-side timing of one op call against the cost of copying its bytes once.

The floor of a memory-bound op is reading its inputs and writing its outputs once; a numpy
copy of (bytes read + bytes written) / 2 bytes into a preallocated buffer moves exactly that
many bytes. Every figure is a median over repeats measured in the same run, so ratios hold
on a noisy machine even when absolute times do not.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

import moe_onnx
from moe_onnx.builders import single_node_model
from moe_onnx.custom_ops import OpDef, buffers


@dataclass
class Case:
    """One op call at one shape."""

    op_type: str
    preset: str
    inputs: dict[str, np.ndarray | None]
    attrs: dict = field(default_factory=dict)
    outputs: list[str] | None = None  # node outputs, "" = absent; default: all

    @property
    def op(self) -> OpDef:
        return moe_onnx.OPS[self.op_type]

    def call_kernel(self):
        """The bare kernel; its outputs are new arrays (fresh pages from the OS)."""
        return self.op.kernel(*self.inputs.values(), **self.op.bind_attrs(self.attrs))

    def call_kernel_recycled(self) -> None:
        """The bare kernel as the session calls it: outputs in memory recycled from the
        previous call, which nothing references any more (``buffers.recycled_outputs``),
        as the floor copies into a preallocated buffer."""
        with buffers.recycled_outputs():
            self.call_kernel()

    def io_bytes(self) -> tuple[int, int]:
        read = sum(x.nbytes for x in self.inputs.values() if x is not None)
        written = sum(y.nbytes for y in self.call_kernel() if y is not None)
        return read, written


def _nothing() -> None:
    pass


def median_seconds(
    fn: Callable[[], object], repeats: int = 5, warmup: int = 1, between: Callable[[], None] = _nothing
) -> float:
    """Median seconds of ``fn`` over ``repeats`` calls after ``warmup`` ones; ``between()``
    runs before each call, untimed (where an interrupt may stop the measurement)."""
    for _ in range(warmup):
        between()
        fn()
    times = []
    for _ in range(repeats):
        between()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def interleaved_seconds(
    paths: dict[str, Callable[[], object]],
    repeats: int = 5,
    warmup: int = 1,
    between: Callable[[], None] = _nothing,
    lead: int = 0,
) -> tuple[dict[str, float], dict[str, float]]:
    """Median seconds of each path, and its median ratio to the first path (the floor).

    The paths run in turn, round after round, so a noisy spell on a shared machine slows
    every path of a round alike; each ratio is taken within a round. ``between()`` runs
    before each call, untimed; then ``lead`` untimed calls of the same path (its threads
    awake and its caches as a loop over it leaves them: the steady state, not the path
    before's).
    """
    for _ in range(warmup):
        for fn in paths.values():
            between()
            fn()
    times: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(repeats):
        for name, fn in paths.items():
            between()
            for _ in range(lead):
                fn()
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    floor = np.array(times[next(iter(paths))])
    medians = {name: float(np.median(t)) for name, t in times.items()}
    ratios = {name: float(np.median(np.array(t) / floor)) for name, t in times.items()}
    return medians, ratios


#: bytes the sources of a cold copy floor span together: more than the caches keep between calls
COLD_SPAN_BYTES = 1 << 30


def copy_floor(nbytes: int, cold: bool = False) -> Callable[[], None]:
    """A numpy copy of ``nbytes`` into a preallocated buffer: from one source (warm in the
    caches after the first call), or with ``cold`` from the next of the consecutive parts of a
    source of COLD_SPAN_BYTES in turn (each call reads bytes from memory, as a layer of a large
    model reads its weights: 7.9 GB/s here against 13.1 for a warm 24 MB source)."""
    size = max(nbytes, 1)
    parts = max(1, -(-COLD_SPAN_BYTES // size)) if cold else 1
    source = np.ones(parts * size, np.uint8)
    target = np.empty(size, np.uint8)
    turn = [0]

    def copy() -> None:
        start = turn[0] * size
        turn[0] = (turn[0] + 1) % parts
        np.copyto(target, source[start : start + size])

    return copy


def measure(case: Case, repeats: int = 5) -> dict:
    """Floor, bare kernel and session timings of ``case``, with their ratios to the floor."""
    read, written = case.io_bytes()
    model = single_node_model(case.op_type, case.inputs, case.attrs, case.outputs)
    session = moe_onnx.InferenceSession(model)
    feeds = {k: v for k, v in case.inputs.items() if v is not None}
    floor = median_seconds(copy_floor((read + written) // 2), repeats)
    kernel = median_seconds(case.call_kernel_recycled, repeats)
    fresh = median_seconds(case.call_kernel, repeats)
    through_session = median_seconds(lambda: session.run(None, feeds), repeats)
    return {
        "op": case.op_type,
        "preset": case.preset,
        "bytes_read": read,
        "bytes_written": written,
        "floor_s": floor,
        "kernel_s": kernel,
        "kernel_fresh_s": fresh,
        "session_s": through_session,
        "kernel_x_floor": kernel / floor,
        "kernel_fresh_x_floor": fresh / floor,
        "session_x_floor": through_session / floor,
    }


def markdown_table(rows: list[dict]) -> str:
    head = (
        "| op | preset | MB moved | floor ms | kernel ms (x floor) | session ms (x floor) |\n"
        "|---|---|---:|---:|---:|---:|\n"
    )
    lines = [
        f"| {r['op']} | {r['preset']} | {(r['bytes_read'] + r['bytes_written']) / 1e6:.0f} | "
        f"{r['floor_s'] * 1e3:.1f} | {r['kernel_s'] * 1e3:.1f} ({r['kernel_x_floor']:.2f}x) | "
        f"{r['session_s'] * 1e3:.1f} ({r['session_x_floor']:.2f}x) |"
        for r in rows
    ]
    return head + "\n".join(lines)


#: the steady protocol (:func:`steady_seconds`): seconds of sleep before each path's calls,
#: longer than onnxruntime's idle pool threads spin after a run (~25 ms with its default options)
STEADY_SETTLE_SECONDS = 0.05
#: ... and untimed calls of the path right before its timed one
STEADY_LEAD = 2


def steady_seconds(
    paths: dict[str, Callable[[], object]], repeats: int = 5, lead: int = STEADY_LEAD
) -> tuple[dict[str, float], dict[str, float]]:
    """:func:`interleaved_seconds` with each timed call in its path's steady state, as a loop
    over it keeps it: a sleep of :data:`STEADY_SETTLE_SECONDS` (no other path's threads
    spinning), then ``lead`` untimed calls of the same path (0: its first call after the sleep)."""
    settle = functools.partial(time.sleep, STEADY_SETTLE_SECONDS)
    return interleaved_seconds(paths, repeats, between=settle, lead=lead)
