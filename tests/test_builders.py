"""single_node_model: one node from example arrays, inputs by name."""

from __future__ import annotations

import numpy as np
import pytest

from moe_onnx import single_node_model

TOKENS, COUNTS = np.ones((4, 2), np.float32), np.array([[2, 2]], np.int32)


def test_default_outputs_are_the_ones_the_op_gives():
    model = single_node_model("MoeReRoutingV2", {"tokens": TOKENS, "expert_token_num_per_rank": COUNTS})
    assert list(model.graph.node[0].output) == [
        "permute_tokens",
        "permute_per_token_scales",
        "permute_token_idx",
        "expert_token_num",
    ]


def test_an_input_after_an_absent_optional_one_keeps_its_place():
    weight = np.ones((4, 1), np.float32)
    model = single_node_model(
        "MoeReRoutingV2", {"expert_topk_weight": weight, "tokens": TOKENS, "expert_token_num_per_rank": COUNTS}
    )
    node = model.graph.node[0]
    assert list(node.input) == ["tokens", "expert_token_num_per_rank", "", "expert_topk_weight"]
    assert node.output[-1] == "permute_topk_weight"


def test_unknown_input_names_and_dtypes_are_refused():
    with pytest.raises(ValueError, match=r"has no input\(s\) \['token'\]"):
        single_node_model("MoeReRouting", {"token": TOKENS, "expert_token_num_per_rank": COUNTS})
    with pytest.raises(ValueError, match="complex64"):
        single_node_model("MoeReRouting", {"tokens": TOKENS.astype(np.complex64), "expert_token_num_per_rank": COUNTS})
