"""Output memory recycling: only inside the glue's context, never visible to callers."""

from __future__ import annotations

import ml_dtypes
import numpy as np

import moe_onnx
from moe_onnx.custom_ops import buffers
from tests.support import node_model


def test_outside_the_context_every_output_is_fresh():
    a = buffers.empty((1024, 1024), np.float32)
    b = buffers.empty((1024, 1024), np.float32)
    assert not np.shares_memory(a, b)


def test_inside_the_context_memory_nothing_references_is_reused():
    with buffers.recycled_outputs():
        first = buffers.empty((1024, 1024), np.float32)
        also = buffers.empty((1024, 1024), np.float32)
        small = buffers.empty(16, np.float32)
    assert not np.shares_memory(first, also)
    first_address = first.ctypes.data
    view = first[1:]
    del first
    with buffers.recycled_outputs():
        held = buffers.empty((1024, 1024), np.float32)  # `view` still holds the first buffer
    assert not np.shares_memory(held, view) and not np.shares_memory(held, also)
    del view
    with buffers.recycled_outputs():
        again = buffers.empty((2048, 1024), np.uint16)  # same bytes, another dtype/shape
        assert again.flags.c_contiguous and again.shape == (2048, 1024)
    assert again.ctypes.data == first_address
    assert not np.shares_memory(again, also) and not np.shares_memory(again, held)
    assert small.base is None  # below MIN_BYTES: plain numpy


def test_session_outputs_never_alias_recycled_memory():
    """Two runs with different inputs: the first run's outputs must not change."""
    rng = np.random.default_rng(0)
    counts = np.array([[300, 200], [100, 424]], np.int32)
    tokens = rng.standard_normal((1024, 1024)).astype(ml_dtypes.bfloat16)
    inputs = {"tokens": tokens, "expert_token_num_per_rank": counts}
    session = moe_onnx.InferenceSession(node_model("MoeReRoutingV2", inputs, outputs=["a", "b", "c", "d", ""]))
    first = session.run(None, inputs)[0]
    kept = first.copy()
    second = session.run(
        None,
        {"tokens": (tokens.astype(np.float32) + 1).astype(ml_dtypes.bfloat16), "expert_token_num_per_rank": counts},
    )[0]
    assert np.array_equal(first.view(np.uint16), kept.view(np.uint16))
    assert not np.array_equal(first.view(np.uint16), second.view(np.uint16))
