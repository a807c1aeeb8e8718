"""`shard_experts` on models exported by moe_onnx.torch: a two-layer single-device MoE written
the way cann-recipes-infer writes its layers (torch_npu's names through the stand-ins:
npu_moe_gating_top_k_softmax, npu_moe_init_routing_v2, npu_grouped_matmul, npu_swiglu,
npu_moe_finalize_routing; the shared expert in plain torch), exported with a dynamic token
count, then sharded over 2 and 4 ranks: every rank gives the exported single-device model's
output on its own batch."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch  # a declared test dependency (the test extra)

from moe_onnx import InferenceSession
from moe_onnx.converters import shard_experts
from moe_onnx.ranks import ThreadRanks
from tests.support import one_product_path

EXPERTS, HIDDEN, FFN, TOP_K, LAYERS = 8, 16, 8, 2, 2


def _experts(rows, weight, group_list):
    """One product per expert's rows, as cann-recipes' FusedMoEGMM calls it."""
    import torch_npu

    return torch_npu.npu_grouped_matmul(
        [rows], [weight], group_list=group_list, group_type=0, group_list_type=1, split_item=3
    )[0]


class RecipeMoe(torch.nn.Module):
    """``forward(x [T, H]) -> [T, H]``: LAYERS cann-recipes-style MoE layers with a shared
    expert; the expert weights as FusedMoEGMM holds them after loading ([E, H, 2F], [E, F, H])."""

    def __init__(self, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        for layer in range(LAYERS):
            self.register_buffer(f"router{layer}", torch.randn(HIDDEN, EXPERTS, generator=g) / HIDDEN**0.5)
            self.register_buffer(f"w13_{layer}", torch.randn(EXPERTS, HIDDEN, 2 * FFN, generator=g) / HIDDEN**0.5)
            self.register_buffer(f"w2_{layer}", torch.randn(EXPERTS, FFN, HIDDEN, generator=g) / FFN**0.5)
            self.register_buffer(f"shared_up{layer}", torch.randn(HIDDEN, 2 * FFN, generator=g) / HIDDEN**0.5)
            self.register_buffer(f"shared_down{layer}", torch.randn(FFN, HIDDEN, generator=g) / FFN**0.5)

    def forward(self, x):
        import torch_npu  # the stand-in (install_stand_ins)

        for layer in range(LAYERS):
            logits = x @ getattr(self, f"router{layer}")
            topk_weight, topk_ids, _ = torch_npu.npu_moe_gating_top_k_softmax(logits, k=TOP_K)
            expanded_x, expanded_row_idx, tokens_per_expert, _ = torch_npu.npu_moe_init_routing_v2(
                x,
                expert_idx=topk_ids,
                expert_num=EXPERTS,
                expert_tokens_num_type=1,
                expert_tokens_num_flag=True,
                active_expert_range=[0, EXPERTS],
                quant_mode=-1,
            )
            group_list = tokens_per_expert.to(torch.int64)

            h = torch_npu.npu_swiglu(_experts(expanded_x, getattr(self, f"w13_{layer}"), group_list))
            out = _experts(h, getattr(self, f"w2_{layer}"), group_list)
            up = x @ getattr(self, f"shared_up{layer}")
            gate, lin = up.chunk(2, dim=-1)
            shared = (torch.nn.functional.silu(gate) * lin) @ getattr(self, f"shared_down{layer}")
            x = torch_npu.npu_moe_finalize_routing(
                out,
                skip1=shared,
                skip2=x,
                bias=None,
                scales=topk_weight,
                expanded_src_to_dst_row=expanded_row_idx,
                export_for_source_row=None,
                drop_pad_mode=2,
            )
        return x


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> onnx.ModelProto:
    import moe_onnx.torch as mt

    mt.install_stand_ins()
    path = tmp_path_factory.mktemp("export") / "moe.onnx"
    example = torch.randn(7, HIDDEN, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        mt.export(RecipeMoe().eval(), (example,), path, dynamic_shapes=({0: torch.export.Dim("T")},))
    return onnx.load(str(path))


@pytest.mark.parametrize("ranks", [2, 4])
def test_exported_recipe_model_shards(exported, ranks):
    routings = [n for n in exported.graph.node if n.op_type.startswith("MoeInitRouting")]
    assert len(routings) == LAYERS
    shards, report = shard_experts(exported, ranks)
    assert [layer.local_experts for layer in report.layers] == [EXPERTS // ranks] * LAYERS
    rng = np.random.default_rng(ranks)
    xs = [rng.standard_normal((t, HIDDEN)).astype(np.float32) for t in [5, 0, 11, 3][:ranks]]
    single = InferenceSession(exported)
    got = ThreadRanks(shards, timeout=120).run([{"x": x} for x in xs])
    for rank, (x, outputs) in enumerate(zip(xs, got)):
        want = single.run(None, {single.get_inputs()[0].name: x})[0]
        # an expert's group holds other rows on its rank than on the single device, and
        # GroupedMatmul's product path depends on the group's rows (docs/expert-parallelism.md)
        np.testing.assert_allclose(
            outputs[0], want, rtol=0, atol=1e-6 * float(np.abs(want).max(initial=0)), err_msg=f"rank {rank}"
        )
    with one_product_path():  # one path for every group: bit-identical
        got = ThreadRanks(shards, timeout=120).run([{"x": x} for x in xs])
        for rank, (x, outputs) in enumerate(zip(xs, got)):
            want = single.run(None, {single.get_inputs()[0].name: x})[0]
            np.testing.assert_array_equal(outputs[0], want, err_msg=f"rank {rank}")
