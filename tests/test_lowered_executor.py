"""InferenceSession(executor="lowered"): our ops as standard ONNX in onnxruntime, collectives
on the kernels; a failed check of a lowered body is the MoeOpError it names."""

from __future__ import annotations

import numpy as np
import pytest

import moe_onnx
from moe_onnx.converters import insert_rerouting
from moe_onnx.models.ep_layer import LayerConfig, build_rank_model, example_inputs, make_weights
from moe_onnx.ranks import ThreadRanks
from moe_onnx.runtime.split import KernelStep
from tests.support import assert_same_bits

TOKENS = np.arange(24, dtype=np.float32).reshape(6, 4)
COUNTS = np.array([[2, 1], [0, 3]], np.int32)


def kernels(session) -> list[str]:
    """The ops a session runs as kernel calls (the rest runs in onnxruntime)."""
    return [step.node.op.name for step in session._executor.steps if isinstance(step, KernelStep)]


def test_movement_ops_give_the_kernels_bits():
    model = moe_onnx.single_node_model("MoeReRouting", {"tokens": TOKENS, "expert_token_num_per_rank": COUNTS})
    feeds = {"tokens": TOKENS, "expert_token_num_per_rank": COUNTS}
    want = moe_onnx.InferenceSession(model).run(None, feeds)
    lowered = moe_onnx.InferenceSession(model, executor="lowered")
    assert kernels(lowered) == []  # onnxruntime runs all of it
    for g, w in zip(lowered.run(None, feeds), want):
        assert_same_bits(g, w)


def test_sums_are_within_float32_accumulation_error():
    rng = np.random.default_rng(0)
    grad = rng.standard_normal((8, 5)).astype(np.float32)
    index = rng.permutation(8).astype(np.int32)
    inputs = {"grad_expanded_x": grad, "expanded_row_idx": index}
    model = moe_onnx.single_node_model("MoeInitRoutingV2Grad", inputs, {"top_k": 2})
    (want,) = moe_onnx.InferenceSession(model).run(None, inputs)
    (got,) = moe_onnx.InferenceSession(model, executor="lowered").run(None, inputs)
    terms = np.abs(grad[index].reshape(4, 2, 5)).sum(axis=1)
    assert np.all(np.abs(got - want) <= 1e-6 * terms)


def test_a_failed_check_is_the_moe_op_error_it_names():
    model = moe_onnx.single_node_model("MoeReRouting", {"tokens": TOKENS, "expert_token_num_per_rank": COUNTS})
    session = moe_onnx.InferenceSession(model, executor="lowered")
    with pytest.raises(moe_onnx.MoeOpError, match="must equal A") as refused:
        session.run(None, {"tokens": TOKENS, "expert_token_num_per_rank": COUNTS * 2})
    assert refused.value.op_type == "MoeReRouting" and refused.value.node_name == "node"


def test_a_converted_ep_layer_runs_lowered_on_four_ranks_with_the_same_bits():
    config = LayerConfig(ranks=4)
    weights = make_weights(config, seed=2)
    models = [insert_rerouting(build_rank_model(config, weights, r))[0] for r in range(4)]
    feeds = [{"x": x} for x in example_inputs(config, seed=2)]
    want = ThreadRanks(models).run(feeds)
    lowered = ThreadRanks(models, executor="lowered")
    assert kernels(lowered.sessions[0]) == ["AllToAll", "AllToAll", "AllToAll"]  # counts, tokens, back
    got = lowered.run(feeds)
    for (g,), (w,) in zip(got, want):
        assert_same_bits(g, w)
