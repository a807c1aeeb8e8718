"""torch_npu aliases: the documented examples give the documented results on a CPU, and
arguments the ONNX ops have no counterpart for are refused by name."""

from __future__ import annotations

import pytest
import torch

import moe_onnx
import moe_onnx.torch as mt
from moe_onnx.torch import npu


def test_permute_doc_example():
    """torch_npu-npu_moe_token_permute_with_routing_map.md, single-op example."""
    tokens = torch.tensor([[0.1] * 4, [0.2] * 4, [0.3] * 4], dtype=torch.float16)
    routing_map = torch.ones((3, 2), dtype=torch.int8)
    permuted, permuted_probs, sorted_indices = npu.npu_moe_token_permute_with_routing_map(
        tokens, routing_map, num_out_tokens=6
    )
    assert permuted_probs is None
    assert sorted_indices.tolist() == [0, 3, 1, 4, 2, 5]
    assert torch.equal(permuted, torch.cat([tokens, tokens]))
    assert torch.equal(permuted[sorted_indices.long()], tokens.repeat_interleave(2, 0))
    probs = torch.tensor([[0.5, 0.3], [0.4, 0.6], [0.2, 0.8]], dtype=torch.float16)
    _, permuted_probs, _ = npu.npu_moe_token_permute_with_routing_map(
        tokens, routing_map, probs=probs, num_out_tokens=6
    )
    assert torch.equal(permuted_probs, probs.T.reshape(-1))
    padded, _, padded_indices = npu.npu_moe_token_permute_with_routing_map(
        tokens, routing_map, num_out_tokens=4, drop_and_pad=True
    )
    assert padded.shape == (4, 4) and padded_indices.shape == (4,)


def test_permute_rounds_rows_down_and_defaults_to_tokens_num():
    tokens, routing_map = torch.randn(3, 2), torch.ones((3, 2), dtype=torch.bool)
    assert npu.npu_moe_token_permute_with_routing_map(tokens, routing_map, num_out_tokens=7)[0].shape == (6, 2)
    single = torch.zeros((3, 2), dtype=torch.bool)
    single[:, 1] = True
    assert npu.npu_moe_token_permute_with_routing_map(tokens, single)[0].shape == (3, 2)


def test_unpermute_doc_examples():
    """torch_npu-npu_moe_token_unpermute_with_routing_map.md, both single-op examples."""
    permuted = torch.tensor([[1, 1, 1, 1], [2, 2, 2, 2]], dtype=torch.float16)
    sorted_indices = torch.tensor([0, 1], dtype=torch.int32)
    routing_map = torch.tensor([[1, 0], [0, 1]], dtype=torch.int8)
    probs = torch.tensor([[1, 0], [0, 1]], dtype=torch.float16)
    out = npu.npu_moe_token_unpermute_with_routing_map(
        permuted, sorted_indices, [2, 4], probs=probs, routing_map=routing_map
    )
    assert torch.equal(out, permuted)
    half = torch.tensor([[0.5, 0], [0, 0.5]], dtype=torch.float16)
    out = npu.npu_moe_token_unpermute_with_routing_map(
        permuted, sorted_indices, [2, 4], probs=half, routing_map=routing_map, drop_and_pad=True
    )
    assert out.tolist() == [[0.5] * 4, [1.0] * 4]


def test_re_routing_is_moe_re_routing():
    tokens = torch.randint(-10, 20, (10, 8), dtype=torch.int8)
    counts = torch.tensor([[1, 2], [3, 4]], dtype=torch.int32)
    scales = torch.randn(10)
    got = npu.npu_moe_re_routing(tokens, counts, per_token_scales=scales)
    want = mt.moe_re_routing(tokens, counts, scales)
    assert len(got) == 4 and all(torch.equal(a, b) for a, b in zip(got, want))
    assert got[3].tolist() == [4, 6]


def test_init_routing_v2_maps_its_arguments():
    x = torch.randn(6, 4)
    expert_idx = torch.randint(0, 5, (6, 2), dtype=torch.int32)
    expanded, row_idx, counts, scale = npu.npu_moe_init_routing_v2(
        x, expert_idx, expert_num=5, expert_tokens_num_type=1, expert_tokens_num_flag=True
    )
    want = mt.moe_init_routing_v2(x, expert_idx, expert_num=5, expert_tokens_count_or_cumsum_flag=2)
    assert torch.equal(expanded, want[0]) and torch.equal(row_idx, want[1]) and scale is None
    assert counts.dtype == torch.int64 and counts.tolist() == want[2].tolist()
    _, _, cumsum, _ = npu.npu_moe_init_routing_v2(x, expert_idx, expert_num=5, expert_tokens_num_flag=True)
    assert cumsum.tolist() == torch.cumsum(want[2], 0).tolist()
    active, _, none, _ = npu.npu_moe_init_routing_v2(x, expert_idx, active_num=5)
    assert active.shape == (5, 4) and none is None
    padded, _, _, _ = npu.npu_moe_init_routing_v2(x, expert_idx, expert_num=5, drop_pad_mode=1, expert_capacity=2)
    assert padded.shape == (5, 2, 4)


@pytest.mark.parametrize(
    "argument, value",
    [
        ("scale", torch.ones(6)),
        ("quant_mode", 1),
        ("row_idx_type", 1),
        ("active_expert_range", [1, 3]),
        ("expert_tokens_num_type", 2),
    ],
)
def test_init_routing_v2_refuses_what_the_onnx_op_lacks(argument, value):
    x, expert_idx = torch.randn(6, 4), torch.zeros(6, 2, dtype=torch.int32)
    with pytest.raises(moe_onnx.MoeOpError, match=f"torch_npu.npu_moe_init_routing_v2: {argument}=.* is not supported"):
        npu.npu_moe_init_routing_v2(x, expert_idx, expert_num=4, expert_tokens_num_flag=True, **{argument: value})


def test_aliases_are_exported_from_the_package():
    assert npu.NAMES
    for name in npu.NAMES:
        assert getattr(mt, name) is getattr(npu, name)
        assert "Source: Ascend/op-plugin" in getattr(npu, name).__doc__
