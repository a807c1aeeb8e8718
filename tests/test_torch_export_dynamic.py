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


class IntOfSizeLayer(torch.nn.Module):
    def forward(self, x, idx):
        rows, _ = mt.moe_token_permute(x, idx, num_out_tokens=int(x.shape[0]) * idx.shape[1])  # a Python int
        return rows


class StandInLayer(torch.nn.Module):
    def forward(self, x, idx):
        import torch_npu

        rows, _ = torch_npu.npu_moe_token_permute(x, idx, num_out_tokens=x.shape[0] - 2)
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
    with pytest.raises(StaticExportError, match="input x dim 0 \\(exported as 9\\)") as raised:
        mt.export(SpecialisingLayer(), _inputs(9), path, dynamic_shapes=({0: T}, {0: T}))
    assert not path.exists()
    # the refusal behind the fallback, the op, its argument and the caller's line
    assert "MoeTokenPermute: attribute num_out_tokens = s" in str(raised.value)
    assert "in cann.moe::MoeTokenPermute argument num_out_tokens" in str(raised.value)
    line = f"{__file__}:{_line_of('num_out_tokens=x.shape[0] - 1')} in forward: rows, _ = mt.moe_token_permute("
    assert line in str(raised.value)


def _line_of(text: str) -> int:
    """The line of this file that holds ``text``."""
    with open(__file__) as source:
        return next(number for number, line in enumerate(source, 1) if text in line)


def test_a_python_int_of_the_size_is_named_with_torch_guard_and_line(tmp_path):
    """torch fixes T where ``int(x.shape[0])`` is taken (its guard Eq(T, 9)); the error says so."""
    T = torch.export.Dim("T")
    with pytest.raises(StaticExportError) as raised:
        mt.export(IntOfSizeLayer(), _inputs(9), tmp_path / "m.onnx", dynamic_shapes=({0: T}, {0: T}))
    message = str(raised.value)
    assert f"x.shape[0] == 9 at {__file__}:{_line_of('int(x.shape[0]) * idx')} in forward" in message
    assert message.count(" == 9 at ") == 1, message  # not the unification of idx's T with x's after the trace


def test_a_stand_in_that_specialises_is_named(tmp_path):
    mt.install_stand_ins()
    T = torch.export.Dim("T")
    with pytest.raises(StaticExportError) as raised:
        mt.export(StandInLayer(), _inputs(9), tmp_path / "m.onnx", dynamic_shapes=({0: T}, {0: T}))
    message = str(raised.value)
    assert "in cann.moe::MoeTokenPermute argument num_out_tokens (torch_npu.npu_moe_token_permute)" in message
    assert f"{__file__}:{_line_of('num_out_tokens=x.shape[0] - 2')} in forward" in message


def test_the_shape_logger_is_left_as_it_was(tmp_path):
    import logging

    logger = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    before = (logger.level, logger.propagate, list(logger.handlers))
    T = torch.export.Dim("T")
    with pytest.raises(StaticExportError):
        mt.export(IntOfSizeLayer(), _inputs(9), tmp_path / "m.onnx", dynamic_shapes=({0: T}, {0: T}))
    assert (logger.level, logger.propagate, list(logger.handlers)) == before
