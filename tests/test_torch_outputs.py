"""Every output of the stand-ins is an ordinary torch allocation (SPEC-layer 1.18 amended):
its storage can be resized (vLLM-Ascend frees its all-to-all buffers with
``untyped_storage().resize_(0)``), and the rows the kernels write are not copied on the way out."""

from __future__ import annotations

import importlib

import pytest
import torch

from moe_onnx.torch import npu, ops_transformer, outputs
from tests.npu_calls import calls, tensors_of

NAMES = {**npu.NAMES, **ops_transformer.NAMES}
#: the layout helpers return their input or an alias of it: nothing is allocated
ALIASING = {"npu_format_cast", "npu_format_cast_", "get_npu_format"}
#: the MC2 collectives run only on ranks: tests/torch_mc2_worker.py checks their outputs there
COLLECTIVE = set(importlib.import_module("moe_onnx.torch.npu.mc2").__all__)
KERNEL_NAMES = sorted(set(NAMES) - ALIASING - COLLECTIVE)


@pytest.fixture
def copied_outputs(monkeypatch):
    """(shape, dtype) of every output copied into a fresh tensor instead of written in place."""
    copies: list[tuple[tuple, str]] = []
    tensor = outputs.TorchOutputs.tensor

    def recording(self, array, position):
        before = len(self.copied)
        result = tensor(self, array, position)
        if len(self.copied) > before:
            copies.append((array.shape, str(array.dtype)))
        return result

    monkeypatch.setattr(outputs.TorchOutputs, "tensor", recording)
    return copies


def test_every_name_has_a_call():
    assert set(calls()) == set(NAMES) - COLLECTIVE


@pytest.mark.parametrize("name", KERNEL_NAMES)
def test_outputs_and_inputs_stay_resizable(name):
    args, kwargs = calls()[name]
    result = NAMES[name](*args, **kwargs)
    tensors = tensors_of(result)
    assert tensors
    for t in tensors:
        assert t.untyped_storage().resizable()
        before = t.clone()
        t.add_(1) if t.dtype != torch.bool else t.logical_not_()
        assert not torch.equal(t, before) or t.numel() == 0  # in place, on the tensor's own memory
        t.untyped_storage().resize_(0)
        assert t.untyped_storage().nbytes() == 0
        t.set_(torch.empty(3, dtype=t.dtype))
        assert t.shape == (3,)
    for t in tensors_of(list(args) + list(kwargs.values())):
        t.untyped_storage().resize_(0)  # an input lent to a kernel stays resizable too


@pytest.mark.parametrize(
    "name",
    [
        "npu_moe_re_routing",
        "npu_moe_init_routing_v2",
        "npu_moe_token_permute",
        "npu_moe_token_unpermute",
        "npu_moe_token_permute_with_routing_map",
        "npu_moe_finalize_routing",
        "npu_grouped_matmul",
        "npu_swiglu",
        "npu_moe_gating_top_k",
    ],
)
def test_rows_are_written_into_torch_memory_not_copied(name, copied_outputs):
    """Only index outputs a kernel computes with numpy (a few bytes per row) are copied: never
    the rows of H values."""
    args, kwargs = calls()[name]
    copied_outputs.clear()
    NAMES[name](*args, **kwargs)
    assert all(len(shape) == 1 for shape, _ in copied_outputs), copied_outputs


def test_an_output_that_aliases_an_input_is_copied_into_a_fresh_tensor():
    x = torch.randn(4, 8)
    expert_idx = torch.tensor([[0], [1], [2], [3]], dtype=torch.int32)  # K = 1, each token its own expert
    rows, _ = npu.npu_moe_token_permute(x, expert_idx)
    assert torch.equal(rows, x) and rows.data_ptr() != x.data_ptr()
    rows.untyped_storage().resize_(0)
    assert x.untyped_storage().nbytes() == x.numel() * 4
