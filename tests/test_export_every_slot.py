"""Follow-up of issue 20: an init routing's ``active_num`` written as "every slot" of the call
(``topk_ids.shape[0] * topk_ids.shape[1]`` in cann-recipes-infer's Qwen3 / DeepSeek blocks,
``topk_ids.numel()`` in omni-infer, ``active_num=token_count`` for v1 in gpt-oss) is a symbolic
size under ``torch.export`` with a dynamic token count. It exports as the attribute value that
means the same at every T (V3: -1, i.e. T*K rows; v1: 2^31 - 1, min(active_num, T) = T), and
any other symbolic value is still refused."""

from __future__ import annotations

import onnx
import pytest
import torch

import moe_onnx
import moe_onnx.torch as mt
from moe_onnx.torch import npu, ops_transformer

EXPERTS, TOP_K, HIDDEN = 6, 2, 4
T = torch.export.Dim("T")


def routing(tokens: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=g)
    ids = torch.rand(tokens, EXPERTS, generator=g).argsort(1)[:, :TOP_K].to(torch.int32)
    return x, ids


class EverySlotV2(torch.nn.Module):
    """The three spellings of "every slot" that real code passes to the V3 routing."""

    def forward(self, x, ids):
        recipes = npu.npu_moe_init_routing_v2(
            x,
            expert_idx=ids,
            active_num=ids.shape[0] * ids.shape[1],
            expert_num=EXPERTS,
            expert_tokens_num_type=1,
            expert_tokens_num_flag=True,
            active_expert_range=[0, EXPERTS],
            quant_mode=-1,
        )
        omni = npu.npu_moe_init_routing_v2(x, expert_idx=ids, active_num=ids.numel(), expert_num=EXPERTS)
        seeds = ops_transformer.moe_init_routing(
            x, ids, active_num=ids.numel(), expert_num=EXPERTS, expert_tokens_num_flag=True
        )  # (counts as a cumsum: three distinct nodes, which the exporter does not merge)
        return recipes[0], recipes[1], recipes[2], omni[0], omni[1], seeds[0], seeds[2]


class TokenCountV1(torch.nn.Module):
    """gpt-oss's v1 call: ``active_num=token_count`` with the canonical column-major row_idx."""

    def forward(self, x, ids):
        token_count = x.shape[0]
        row_idx = torch.arange(token_count * TOP_K, dtype=torch.int32).view(TOP_K, -1).permute(1, 0).contiguous()
        expanded_x, expanded_row_idx, expanded_expert_idx = npu.npu_moe_init_routing(
            x, row_idx=row_idx, expert_idx=ids, active_num=token_count
        )
        return expanded_x, expanded_row_idx, npu.npu_moe_compute_expert_tokens(expanded_expert_idx, EXPERTS)


def active_nums(path) -> list[int]:
    model = onnx.load(str(path))
    return [
        onnx.helper.get_attribute_value(a)
        for n in model.graph.node
        if n.op_type in ("MoeInitRoutingV3", "MoeInitRouting")
        for a in n.attribute
        if a.name == "active_num"
    ]


@pytest.mark.parametrize(
    ("module", "attribute"), [(EverySlotV2(), [-1, -1, -1]), (TokenCountV1(), [2**31 - 1])], ids=["v2", "v1"]
)
def test_every_slot_exports_with_a_dynamic_token_count_and_runs_like_eager(tmp_path, module, attribute):
    path = tmp_path / "routing.onnx"
    mt.export(module.eval(), routing(5, 0), path, dynamic_shapes=({0: T}, {0: T}))
    assert active_nums(path) == attribute
    session = moe_onnx.InferenceSession(str(path))
    for tokens in (5, 1, 12):
        x, ids = routing(tokens, tokens)
        got = session.run(None, {"x": x.numpy(), "ids": ids.numpy()})
        want = module(x, ids)
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert g.shape == tuple(w.shape) and g.tobytes() == w.numpy().tobytes()
        assert got[0].shape[0] == tokens * TOP_K  # every slot's row, at this T


class OtherSymbolic(torch.nn.Module):
    def __init__(self, version: int):
        super().__init__()
        self.version = version

    def forward(self, x, ids):
        if self.version == 2:  # the token count: fewer rows than slots, a value that follows T
            return npu.npu_moe_init_routing_v2(x, expert_idx=ids, active_num=ids.shape[0], expert_num=EXPERTS)[0]
        row_idx = torch.arange(ids.numel(), dtype=torch.int32).view(TOP_K, -1).T.contiguous()
        return npu.npu_moe_init_routing(x, row_idx, ids, active_num=x.shape[0] // 2)[0]


@pytest.mark.parametrize(("version", "op_type"), [(2, "MoeInitRoutingV3"), (1, "MoeInitRouting")])
def test_any_other_symbolic_active_num_is_refused(version, op_type):
    with pytest.raises(TypeError, match=rf"{op_type}: attribute active_num = .*s\d+.* is symbolic"):
        torch.export.export(OtherSymbolic(version), routing(6, 1), dynamic_shapes=({0: T}, {0: T}))


def test_eager_values_are_passed_as_they_are():
    """Outside export the value is an int and reaches the op unchanged (the same rows)."""
    x, ids = routing(4, 2)
    capped = npu.npu_moe_init_routing_v2(x, expert_idx=ids, active_num=3, expert_num=EXPERTS)[0]
    assert capped.shape == (3, HIDDEN)
    row_idx = torch.arange(ids.numel(), dtype=torch.int32).view(TOP_K, -1).T.contiguous()
    assert npu.npu_moe_init_routing(x, row_idx, ids, active_num=1)[0].shape == (TOP_K, HIDDEN)
