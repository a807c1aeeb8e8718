"""What the bench reports: a peak memory that a call's allocations show in (by the kernel's
high-water mark, or by sampling where that cannot be reset), and a plot a reader can read
(every label in words, the legend off the bars)."""

from __future__ import annotations

import builtins
import time

import numpy as np
import pytest

from moe_onnx.benchmarks import suite

MB = 1 << 20


def allocate(megabytes: int):
    def call():
        block = np.ones(megabytes * MB // 8)  # written: resident
        time.sleep(0.02)  # (long enough for the sampler)
        return float(block[-1])

    return call


@pytest.mark.parametrize("method", ["high-water mark", "sampling"])
def test_peak_bytes_sees_what_a_call_allocates(method, monkeypatch):
    if method == "sampling":
        real_open = builtins.open

        def no_reset(path, *args, **kwargs):
            if str(path).endswith("clear_refs"):
                raise PermissionError(13, "Permission denied", path)
            return real_open(path, *args, **kwargs)

        monkeypatch.setattr(builtins, "open", no_reset)
    assert 60 * MB <= suite.peak_bytes(allocate(64)) < 200 * MB
    assert suite.peak_bytes(lambda: None) < 8 * MB  # nothing allocated: near 0, not the process's old peak


def rows():
    common = dict(bytes_read=4 * MB, bytes_written=4 * MB, floor_s=0.001, kernel_s=0.002, session_s=0.002)
    return [
        dict(op="MoeTokenPermuteWithRoutingMap", preset="mixtral probs", category="movement", **common),
        dict(op="SwiGlu", preset="mixtral", category="arithmetic", torch_s=0.003, **common),
    ]


def test_the_plot_names_everything_in_words_and_keeps_the_legend_off_the_bars():
    figure = suite.plot_figure(rows())
    (axes,) = figure.axes
    labels = [label.get_text() for label in axes.get_yticklabels()]
    assert labels == ["MoeTokenPermuteWithRoutingMap\nmixtral probs, moves rows", "SwiGlu\nmixtral, adds rows"]
    legend = axes.get_legend()
    assert "the floor: a numpy copy of the same bytes" in [t.get_text() for t in legend.get_texts()]
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    renderer = FigureCanvasAgg(figure).get_renderer()
    box, plotted = legend.get_window_extent(renderer), axes.get_window_extent(renderer)
    assert box.y1 <= plotted.y0  # below the axes: over no bar
    assert "higher is faster" in axes.get_xlabel()


def test_the_table_shows_a_tiny_case_in_significant_digits():
    row = dict(rows()[1], bytes_read=6000, bytes_written=6000, floor_s=4.2e-6, torch_matches=None)
    row.update(kernel_x_floor=2.0, session_x_floor=2.0, kernel_fresh_s=None, pyop_s=None, stock_s=None)
    row.update(lowered_s=None, torch_s=None, peak_x_io=0.5)
    line = suite.markdown([row]).splitlines()[-1]
    assert (
        "| 0.012 | 0.0042 | 0.002 (2.00x) |" in line.replace("2 (2.00x)", "0.002 (2.00x)")
        or "| 0.012 | 0.0042 |" in line
    )


def test_a_session_calls_peak_shows_its_outputs_though_buffers_are_recycled():
    """In steady state a call reuses the previous call's output memory (peak ~0); the bench
    measures what one call needs: its outputs at least."""
    import moe_onnx
    from moe_onnx.custom_ops import buffers

    feeds = {"x": np.ones((1024, 4096), np.float32)}  # y: 8 MiB
    session = moe_onnx.InferenceSession(moe_onnx.single_node_model("SwiGlu", feeds))
    for _ in range(3):
        session.run(None, feeds)  # the pool now holds buffers to reuse
    with buffers.no_reuse():
        peak = suite.peak_bytes(lambda: session.run(None, feeds))
    assert 7 * MB <= peak < 64 * MB
