"""torch_npu aliases: the documented examples give the documented results on a CPU, and
arguments the ONNX ops have no counterpart for are refused by name."""

from __future__ import annotations

import pytest
import torch
from onnx import TensorProto, helper

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
    """torch_npu's npu_moe_init_routing_v2 runs MoeInitRoutingV3 (MoeInitRoutingV2KernelNpuOpApi.cpp)."""
    x = torch.randn(6, 4)
    expert_idx = torch.randint(0, 5, (6, 2), dtype=torch.int32)
    expanded, row_idx, counts, scale = npu.npu_moe_init_routing_v2(
        x, expert_idx, expert_num=5, expert_tokens_num_type=1, expert_tokens_num_flag=True
    )
    want = mt.moe_init_routing_v2(x, expert_idx, expert_num=5, expert_tokens_count_or_cumsum_flag=2)
    assert torch.equal(expanded, want[0]) and torch.equal(row_idx, want[1])
    assert scale.dtype == torch.float32 and scale.shape == (12,) and not scale.any()  # no scale given
    assert counts.dtype == torch.int64 and counts.tolist() == want[2].tolist()
    _, _, cumsum, _ = npu.npu_moe_init_routing_v2(x, expert_idx, expert_num=5, expert_tokens_num_flag=True)
    assert cumsum.tolist() == torch.cumsum(want[2], 0).tolist()
    active, _, unwritten, _ = npu.npu_moe_init_routing_v2(x, expert_idx, expert_num=5, active_num=5)
    assert active.shape == (5, 4) and unwritten.tolist() == [0] * 5
    padded, _, _, _ = npu.npu_moe_init_routing_v2(x, expert_idx, expert_num=5, drop_pad_mode=1, expert_capacity=2)
    assert padded.shape == (5, 2, 4)


def test_init_routing_v2_doc_example_partial_range_with_scale():
    """torch_npu-npu_moe_init_routing_v2.md, single-op example (bs 1, K 475, E 226, range
    [23, 35], a scale); checked against the doc's CPU reference rewritten in torch."""
    torch.manual_seed(0)
    bs, h, k, active_num, expert_num = 1, 613, 475, 475, 226
    x = torch.randn((bs, h), dtype=torch.float32)
    expert_idx = torch.randint(0, expert_num, (bs, k), dtype=torch.int32)
    scale = torch.randn((bs,), dtype=torch.float32)
    expanded_x, expanded_row_idx, counts, expanded_scale = npu.npu_moe_init_routing_v2(
        x, expert_idx, scale=scale, offset=None, active_num=active_num, expert_capacity=-1, expert_num=expert_num,
        drop_pad_mode=0, expert_tokens_num_type=1, expert_tokens_num_flag=True, active_expert_range=[23, 35],
        quant_mode=-1, row_idx_type=0,
    )  # fmt: skip
    flat = expert_idx.view(-1).long()
    in_range = (flat >= 23) & (flat < 35)
    order = torch.argsort(torch.where(flat < 23, 2**31 - 1, flat), stable=True)
    n = int(in_range.sum())
    assert torch.equal(expanded_x[:n], x[order[:n] // k]) and not expanded_x[n:].any()
    assert torch.equal(expanded_scale[:n], scale[order[:n] // k])
    want_idx = torch.full((k,), -1, dtype=torch.int32)
    want_idx[order[:n]] = torch.arange(n, dtype=torch.int32)
    assert torch.equal(expanded_row_idx, want_idx)
    assert counts.tolist() == torch.bincount(flat[in_range] - 23, minlength=12).tolist()
    _, gather, key_value, _ = npu.npu_moe_init_routing_v2(
        x, expert_idx, expert_num=expert_num, active_expert_range=[23, 35], row_idx_type=1,
        expert_tokens_num_type=2, expert_tokens_num_flag=True,
    )  # fmt: skip
    assert torch.equal(gather, order.to(torch.int32))
    experts = torch.unique(flat[in_range])
    assert key_value.shape == (expert_num, 2) and key_value[: len(experts), 0].tolist() == experts.tolist()


@pytest.mark.parametrize(
    "argument, value, why",
    [("quant_mode", 1, "int8 dynamic quantisation"), ("offset", torch.ones(1), "quantisation"), ("x_dtype", 5, "")],
)
def test_init_routing_v2_refuses_quantisation_by_name(argument, value, why):
    x, expert_idx = torch.randn(6, 4), torch.zeros(6, 2, dtype=torch.int32)
    with pytest.raises(
        moe_onnx.MoeOpError, match=f"torch_npu.npu_moe_init_routing_v2: {argument}=.* is not supported: .*{why}"
    ) as refused:
        npu.npu_moe_init_routing_v2(x, expert_idx, expert_num=4, **{argument: value})
    assert refused.value.code == moe_onnx.custom_ops.BAD_DTYPE  # 161002: not supported, on every target


def test_init_routing_v2_moves_hifloat8_bytes():
    x = torch.randint(0, 256, (6, 4), dtype=torch.uint8)
    expert_idx = torch.randint(0, 3, (6, 2), dtype=torch.int32)
    got, *_ = npu.npu_moe_init_routing_v2(x, expert_idx, expert_num=3, x_dtype=290)  # torch_npu.hifloat8
    assert torch.equal(got, x[torch.argsort(expert_idx.view(-1).long(), stable=True) // 2])


def test_re_routing_takes_tokens_dtype():
    tokens = torch.randint(0, 256, (10, 8), dtype=torch.uint8)
    counts = torch.tensor([[1, 2], [3, 4]], dtype=torch.int32)
    want = npu.npu_moe_re_routing(tokens, counts)
    for value in (290, 296, "float4_e1m2fn_x2"):  # torch_npu.hifloat8, float4_e2m1fn_x2 and a name
        got = npu.npu_moe_re_routing(tokens, counts, tokens_dtype=value)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    with pytest.raises(moe_onnx.MoeOpError, match="torch_npu.npu_moe_re_routing: tokens_dtype=1 is not supported"):
        npu.npu_moe_re_routing(tokens, counts, tokens_dtype=1)
    with pytest.raises(moe_onnx.MoeOpError, match="describes uint8 storage, but tokens are float32"):
        npu.npu_moe_re_routing(tokens.float(), counts, tokens_dtype=290)


def test_private_unpermute_returns_four_tensors_and_the_grads_run():
    """The entry points MindSpeed calls, against the public ones and the ONNX ops."""
    tokens, probs = torch.randn(4, 3), torch.rand(4, 3)
    routing_map = torch.tensor([[1, 1, 0], [0, 1, 1], [1, 0, 1], [1, 1, 0]], dtype=torch.bool)
    permuted, permuted_probs, sorted_indices = npu.npu_moe_token_permute_with_routing_map(
        tokens, routing_map, probs=probs, num_out_tokens=8
    )
    out, out_index, token_id, permute_probs = npu._npu_moe_token_unpermute_with_routing_map(
        permuted, sorted_indices, tokens.shape, probs=probs, routing_map=routing_map
    )
    assert torch.equal(out, npu.npu_moe_token_unpermute_with_routing_map(
        permuted, sorted_indices, tokens.shape, probs=probs, routing_map=routing_map
    ))  # fmt: skip
    assert torch.equal(out_index, sorted_indices) and token_id.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert torch.equal(permute_probs, permuted_probs)
    grad = torch.randn(4, 3)
    for second in (token_id, sorted_indices):  # derivatives.yaml passes sorted_indices twice
        rows_grad, probs_grad = npu.npu_moe_token_unpermute_with_routing_map_grad(
            grad, sorted_indices, second, routing_map, permuted, probs, False, tokens.shape
        )
        torch.testing.assert_close(rows_grad, grad[routing_map.T.nonzero()[:, 1]] * permuted_probs[:, None])
        assert probs_grad.shape == (4, 3)
    tokens_grad, none = npu.npu_moe_token_permute_with_routing_map_grad(
        torch.ones(8, 3), None, sorted_indices, routing_map, 3, 4, False
    )
    assert none is None and tokens_grad.tolist() == [[2.0] * 3] * 4


def test_permute_exports_t_times_k_with_a_dynamic_t(tmp_path):
    """num_out_tokens = tokens.shape[0] * K under a dynamic T exports as the attribute -K (K rows
    per token), and the model runs at other token counts."""

    class Permute(torch.nn.Module):
        def forward(self, tokens, logits):
            _, experts = torch.topk(logits, 2)
            routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, experts, True)
            rows, _, index = npu.npu_moe_token_permute_with_routing_map(
                tokens, routing_map, num_out_tokens=tokens.shape[0] * 2
            )
            return rows, index

    tokens_dim = torch.export.Dim("T")
    path = tmp_path / "permute.onnx"
    mt.export(Permute(), (torch.randn(5, 3), torch.randn(5, 4)), str(path),
              dynamic_shapes=({0: tokens_dim}, {0: tokens_dim}))  # fmt: skip
    import onnx

    node = next(n for n in onnx.load(str(path)).graph.node if n.op_type == "MoeTokenPermuteWithRoutingMap")
    assert onnx.helper.get_attribute_value(next(a for a in node.attribute if a.name == "num_out_tokens")) == -2
    session = moe_onnx.InferenceSession(str(path))
    for n_tokens in (1, 7, 12):
        tokens, logits = torch.randn(n_tokens, 3), torch.randn(n_tokens, 4)
        got = session.run(None, {"tokens": tokens.numpy(), "logits": logits.numpy()})
        want = Permute()(tokens, logits)
        assert got[0].shape == (2 * n_tokens, 3)
        assert all((g == w.numpy()).all() for g, w in zip(got, want))


def test_aliases_are_exported_from_the_package():
    assert npu.NAMES
    for name in npu.NAMES:
        assert getattr(mt, name) is getattr(npu, name)
        assert "Source: Ascend/op-plugin" in getattr(npu, name).__doc__


def test_init_routing_v2_always_returns_the_counts_op_plugin_allocates():
    """SPEC-layer 1.17 (a) amended: int64 [end - start] (or [E, 2] key-value), zeros without the
    flag (the NPU leaves it unwritten); vLLM-Ascend's 310P dispatcher calls .to(torch.int64) on it."""
    x = torch.randn(5, 4)
    expert_idx = torch.tensor([[0, 3], [1, 2], [3, 3], [5, 0], [2, 4]], dtype=torch.int32)
    _, _, counts, _ = npu.npu_moe_init_routing_v2(x, expert_idx, expert_num=6)
    assert counts.dtype == torch.int64 and counts.tolist() == [0] * 6
    _, _, counts, _ = npu.npu_moe_init_routing_v2(x, expert_idx, expert_num=6, active_expert_range=[1, 4])
    assert counts.shape == (3,) and counts.to(torch.int64).sum() == 0
    _, _, counts, _ = npu.npu_moe_init_routing_v2(x, expert_idx, expert_num=6, expert_tokens_num_type=2)
    assert counts.shape == (6, 2)
    _, _, counts, _ = npu.npu_moe_init_routing_v2(
        x, expert_idx, expert_num=6, expert_tokens_num_type=1, expert_tokens_num_flag=True
    )
    assert counts.tolist() == [2, 1, 2, 3, 1, 1]


def test_init_routing_v2_refuses_active_num_below_minus_one():
    """SPEC-layer 1.17 (c) amended (the tiling's CheckAttr), in the stand-in and the lowering."""
    x, expert_idx = torch.randn(3, 4), torch.tensor([[0, 1], [1, 2], [2, 0]], dtype=torch.int32)
    with pytest.raises(moe_onnx.MoeOpError, match="active_num must be >= -1 in dropless mode, got -2"):
        npu.npu_moe_init_routing_v2(x, expert_idx, expert_num=3, active_num=-2)
    node = helper.make_node(
        "MoeInitRoutingV3",
        ["x", "expert_idx"],
        ["expanded_x", "expanded_row_idx", "", "expanded_scale"],
        domain=moe_onnx.DOMAIN,
        expert_num=3,
        active_num=-2,
    )
    graph = helper.make_graph(
        [node],
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4]),
            helper.make_tensor_value_info("expert_idx", TensorProto.INT32, [3, 2]),
        ],
        [helper.make_tensor_value_info("expanded_x", TensorProto.FLOAT, None)],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(moe_onnx.DOMAIN, 1)]
    )
    with pytest.raises(moe_onnx.MoeOpError, match="active_num must be >= -1"):
        moe_onnx.lower(model)


def test_token_permute_refuses_an_output_of_no_rows():
    """SPEC-layer 1.11 (c) amended: num_out_tokens = -T*K would leave 0 rows, which the NPU refuses."""
    x, indices = torch.randn(3, 4), torch.tensor([[0, 1], [1, 2], [2, 0]], dtype=torch.int32)
    with pytest.raises(moe_onnx.MoeOpError, match="num_out_tokens = -6 < 0 must keep F \\+ n > 0 rows"):
        npu.npu_moe_token_permute(x, indices, num_out_tokens=-6)
    assert npu.npu_moe_token_permute(x, indices, num_out_tokens=-5)[0].shape == (1, 4)
