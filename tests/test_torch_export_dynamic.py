"""moe_onnx.torch.export never returns a static model where dynamic_shapes asked for a dynamic
one, and the moe_onnx.torch ops take the symbolic spellings of "every slot" that torch_npu's
names take (num_out_tokens = T*K, active_num = T*K, restore_shape = [T, H])."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import moe_onnx
import moe_onnx.torch as mt
from moe_onnx.torch.export import StaticExportError


class PermuteLayer(torch.nn.Module):
    """A Megatron-style dispatch and combine written with the moe_onnx.torch ops."""

    def forward(self, x, idx):
        rows, sorted_indices = mt.moe_token_permute(x, idx, num_out_tokens=x.shape[0] * idx.shape[1])
        return mt.moe_token_unpermute(rows * 2, sorted_indices, restore_shape=[x.shape[0], x.shape[1]])


class InitRoutingLayer(torch.nn.Module):
    def forward(self, x, idx):
        expanded, _, counts, _ = mt.moe_init_routing_v3(
            x, idx, active_num=idx.shape[0] * idx.shape[1], expert_num=4, expert_tokens_num_flag=1
        )
        return expanded, counts


class SpecialisingLayer(torch.nn.Module):
    def forward(self, x, idx):
        rows, _ = mt.moe_token_permute(x, idx, num_out_tokens=x.shape[0] - 1)  # not every slot: a constant
        return rows


def _inputs(tokens: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, 24, generator=g), torch.randint(0, 4, (tokens, 2), generator=g, dtype=torch.int32)


@pytest.mark.parametrize("layer", [PermuteLayer, InitRoutingLayer])
def test_symbolic_every_slot_exports_dynamic_and_runs_at_other_token_counts(tmp_path, layer):
    T = torch.export.Dim("T")
    path = tmp_path / "layer.onnx"
    mt.export(layer(), _inputs(9), path, dynamic_shapes=({0: T}, {0: T}))
    session = moe_onnx.InferenceSession(str(path))
    for tokens in (5, 17):
        x, idx = _inputs(tokens, seed=tokens)
        want = layer()(x, idx)
        want = want if isinstance(want, tuple) else (want,)
        got = session.run(None, {"x": x.numpy(), "idx": idx.numpy()})
        assert len(got) == len(want)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w.numpy())


def test_an_export_that_would_specialise_raises_naming_the_dim(tmp_path):
    T = torch.export.Dim("T")
    path = tmp_path / "static.onnx"
    with pytest.raises(StaticExportError, match="input x dim 0 \\(exported as 9\\)"):
        mt.export(SpecialisingLayer(), _inputs(9), path, dynamic_shapes=({0: T}, {0: T}))
    assert not path.exists()
