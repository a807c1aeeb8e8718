"""Unused slots (seed 000) in the lowered unpermute and its grad: not padded, a token routed to
fewer than K experts leaves negative slots in ``sorted_indices``, which the kernels skip
(-1 in ``out_index`` and ``permute_token_id``, no term in the sum, no gradient). The lowered
bodies, run in a process that never imports moe_onnx (onnxruntime and onnx.reference, as
functions and inlined), must give the kernels' outputs (see tests/lower_support.py for the
tolerances). The lowered executor runs the same bodies."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import moe_onnx
from moe_onnx.custom_ops.moe_token_unpermute_with_routing_map import moe_token_unpermute_with_routing_map

from .lower_support import LoweredRunner, check_lowered
from .references import routing_with_unused_slots
from .support import assert_same_bits
from .test_lower_ops import FLOATS, OPSETS, floats, probs_dtype_for

UNPERMUTE = "MoeTokenUnpermuteWithRoutingMap"
UNPERMUTE_GRAD = "MoeTokenUnpermuteWithRoutingMapGrad"
FORWARD_SUMS = {"unpermuted_tokens": ("permuted_tokens", "probs")}
GRAD_SUMS = {"probs_grad": ("unpermuted_tokens_grad", "permuted_tokens")}


@pytest.fixture(scope="module")
def runner():
    worker = LoweredRunner()
    yield worker
    worker.close()


def check_both(runner, inputs: dict, attrs: dict, with_probs: bool, inline: bool, opset: int = 21) -> None:
    """The forward on ``inputs``, then its grad fed the kernel's own index pairs."""
    forward_outputs = None if with_probs else ["unpermuted_tokens", "out_index", "permute_token_id"]
    check_lowered(runner, UNPERMUTE, inputs, attrs, forward_outputs, sums=FORWARD_SUMS, inline=inline, opset=opset)
    permuted, sorted_indices, routing_map, probs = inputs.values()
    n_tokens, hidden = attrs["restore_shape"]
    _, out_index, token_id, _ = moe_token_unpermute_with_routing_map(
        permuted, sorted_indices, routing_map, probs, restore_shape=[n_tokens, hidden]
    )
    assert (out_index < 0).any() == (sorted_indices < 0).any()  # the grad sees unused slots too
    rng = np.random.default_rng(len(out_index))
    grad_inputs = {
        "unpermuted_tokens_grad": floats(rng, (n_tokens, hidden), str(permuted.dtype)),
        "out_index": out_index,
        "permute_token_id": token_id,
        "routing_map": routing_map if with_probs else None,
        "permuted_tokens": permuted if with_probs else None,
        "probs": probs if with_probs else None,
    }
    grad_outputs = None if with_probs else ["permuted_tokens_grad"]
    check_lowered(runner, UNPERMUTE_GRAD, grad_inputs, {}, grad_outputs, sums=GRAD_SUMS, inline=inline, opset=opset)


# the kernel's by-hand case (tests/test_routing_map_unpermute.py): T = 3, E = 3, K = 2; token 1
# has one expert, so slot 3 is -1; rows 0..4 are the routed pairs, row 5 is no pair's
BY_HAND = {
    "permuted_tokens": np.arange(12, dtype=np.float32).reshape(6, 2),
    "sorted_indices": np.array([0, 4, 2, -1, 1, 3], np.int32),
    "routing_map": np.array([[1, 0, 1], [0, 1, 0], [1, 1, 0]], bool),
    "probs": np.array([[0.5, 0, 2], [0, 3, 0], [4, 0.25, 0]], np.float32),
}
# every token routed to no expert: every slot unused, R = 0
NONE_ROUTED = {
    "permuted_tokens": np.arange(8, dtype=np.float32).reshape(4, 2),
    "sorted_indices": np.array([-1, -1, -7, -1], np.int32),
    "routing_map": np.zeros((2, 3), np.int8),
    "probs": np.ones((2, 3), np.float32),
}


@pytest.mark.parametrize("inline", [False, True], ids=["functions", "inlined"])
@pytest.mark.parametrize("with_probs", [True, False], ids=["probs", "no-probs"])
@pytest.mark.parametrize("case", ["by hand", "none routed"])
def test_unused_slots_fixed_cases(runner, case, with_probs, inline):
    inputs = dict(BY_HAND if case == "by hand" else NONE_ROUTED)
    n_tokens = inputs["routing_map"].shape[0]
    if not with_probs:
        inputs["probs"] = None
    check_both(runner, inputs, {"restore_shape": [n_tokens, 2]}, with_probs, inline)


@settings(max_examples=30)
@given(
    seed=st.integers(0, 2**32 - 1),
    tokens=st.integers(1, 5),
    experts=st.integers(1, 5),
    top_k=st.integers(1, 5),
    hidden=st.integers(1, 4),
    dtype=st.sampled_from(FLOATS),
    mixed=st.booleans(),
    map_dtype=st.sampled_from(["bool", "int8"]),
    with_probs=st.booleans(),
    other_negatives=st.booleans(),
    inline=st.booleans(),
    opset=st.sampled_from(OPSETS),
)
def test_unused_slots_random(
    runner, seed, tokens, experts, top_k, hidden, dtype, mixed, map_dtype, with_probs, other_negatives, inline, opset
):
    """Tokens routed to 0..K experts; with ``other_negatives`` unused slots hold any negative
    (the kernel takes them all as unused and writes -1)."""
    rng = np.random.default_rng(seed)
    top_k = min(top_k, experts)
    routing_map, sorted_indices = routing_with_unused_slots(rng, tokens, experts, top_k)
    if other_negatives:
        unused = sorted_indices < 0
        sorted_indices[unused] = rng.integers(-(2**31), 0, int(unused.sum()))
    inputs = {
        "permuted_tokens": floats(rng, (tokens * top_k, hidden), dtype),
        "sorted_indices": sorted_indices,
        "routing_map": routing_map if map_dtype == "bool" else routing_map.astype(np.int8),
        "probs": floats(rng, (tokens, experts), probs_dtype_for(dtype, mixed)) if with_probs else None,
    }
    check_both(runner, inputs, {"restore_shape": [tokens, hidden]}, with_probs, inline, opset)


def test_the_lowered_executor_takes_unused_slots_and_refuses_an_unrouted_row():
    """``InferenceSession(executor="lowered")`` gives the kernels' outputs on -1 slots, and a used
    slot naming a row past the routed pairs is the MoeOpError the check names."""
    model = moe_onnx.single_node_model(UNPERMUTE, BY_HAND, {"restore_shape": [3, 2]})
    want = moe_onnx.InferenceSession(model).run(None, BY_HAND)
    lowered = moe_onnx.InferenceSession(model, executor="lowered")
    got = lowered.run(None, BY_HAND)
    assert got[1].tolist() == [0, 4, 2, -1, 1, 3] and got[2].tolist() == [0, 0, 1, -1, 2, 2]
    for g, w in zip(got, want):
        assert_same_bits(g, w)  # small integers: the float32 sums are exact here
    unrouted = dict(BY_HAND, sorted_indices=np.array([0, 4, 2, -1, 5, 3], np.int32))  # row 5: no pair's
    with pytest.raises(moe_onnx.MoeOpError, match="a used slot must name a routed row") as refused:
        lowered.run(None, unrouted)
    assert refused.value.op_type == UNPERMUTE and refused.value.node_name == "node"
