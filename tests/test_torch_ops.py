"""moe_onnx.torch op functions: signatures from the OpDefs, bit-equal to the session's node,
traceable by torch.export / torch.compile, clear errors, torch imported only on request."""

from __future__ import annotations

import inspect
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
import torch

import moe_onnx
import moe_onnx.torch as mt
from moe_onnx.custom_ops import OPS
from moe_onnx.torch.arrays import to_numpy, to_torch
from moe_onnx.torch.schema import snake_case
from tests.support import assert_same_bits, run_node

BF16 = ml_dtypes.bfloat16


def routing_map(rng, tokens, experts, top_k, dtype=np.bool_):
    chosen = np.argsort(rng.random((tokens, experts)), axis=1)[:, :top_k]
    out = np.zeros((tokens, experts), np.bool_)
    np.put_along_axis(out, chosen, True, axis=1)
    return out.astype(dtype)


def normal(rng, shape, dtype):
    return rng.standard_normal(shape).astype(dtype)


def cases():
    """(op_type, inputs by name (None = absent), attributes, id) covering each op's modes."""
    rng = np.random.default_rng(0)
    counts = np.array([[2, 0, 1], [1, 3, 0]], np.int32)
    yield (
        "MoeReRoutingV2",
        {
            "tokens": normal(rng, (7, 5), BF16),
            "expert_token_num_per_rank": counts,
            "per_token_scales": normal(rng, (7,), np.float32),
            "expert_topk_weight": normal(rng, (7, 1), np.float32),
        },
        {"idx_type": 1},
        "bf16-scales-weight-scatter",
    )
    yield (
        "MoeReRoutingV2",
        {
            "tokens": normal(rng, (7, 4), np.float32).astype(ml_dtypes.float8_e4m3fn),
            "expert_token_num_per_rank": counts.astype(np.int64),
            "per_token_scales": rng.integers(100, 140, (7, 2, 2)).astype(np.uint8).view(ml_dtypes.float8_e8m0fnu),
        },
        {"expert_token_num_type": 0},
        "fp8-e8m0-scales-cumsum",
    )
    yield (
        "MoeReRouting",
        {
            "tokens": rng.integers(-9, 9, (7, 3)).astype(np.int8),
            "expert_token_num_per_rank": counts,
        },
        {},
        "int8",
    )
    expert_idx = rng.integers(0, 4, (5, 2)).astype(np.int32)
    yield (
        "MoeInitRoutingV2",
        {"x": normal(rng, (5, 6), np.float32), "expert_idx": expert_idx},
        {
            "expert_num": 4,
            "expert_tokens_count_or_cumsum_flag": 2,
        },
        "dropless-count",
    )
    yield (
        "MoeInitRoutingV2",
        {"x": normal(rng, (5, 6), BF16), "expert_idx": expert_idx},
        {
            "active_num": 7,
            "expert_num": 4,
            "expert_tokens_count_or_cumsum_flag": 1,
        },
        "active-cumsum-bf16",
    )
    yield (
        "MoeInitRoutingV2",
        {"x": normal(rng, (5, 6), np.float16), "expert_idx": expert_idx},
        {
            "drop_pad_mode": 1,
            "expert_capacity": 2,
            "expert_num": 4,
            "expert_tokens_before_capacity_flag": 1,
        },
        "drop-pad-before-capacity",
    )
    yield (
        "MoeInitRoutingV3",
        {"x": normal(rng, (5, 6), BF16), "expert_idx": expert_idx, "scale": normal(rng, (5,), np.float32)},
        {"expert_num": 4, "active_expert_range": [1, 3], "expert_tokens_num_flag": 1, "row_idx_type": 1},
        "partial-range-gather-index-scale",
    )
    yield (
        "MoeInitRoutingV3",
        {"x": rng.integers(0, 256, (5, 6)).astype(np.uint8), "expert_idx": expert_idx},
        {"expert_num": 4, "drop_pad_mode": 1, "expert_capacity": 2, "x_dtype": "hifloat8"},
        "drop-pad-bytes",
    )
    row_idx = np.random.default_rng(1).permutation(10).astype(np.int32)
    yield (
        "MoeInitRoutingV2Grad",
        {"grad_expanded_x": normal(rng, (10, 6), BF16), "expanded_row_idx": row_idx},
        {"top_k": 2},
        "dropless-bf16",
    )
    padded_idx = np.array([0, 5, -1, 2, 7, 1], np.int32)
    grad = normal(rng, (4, 2, 3), np.float32)
    yield (
        "MoeInitRoutingV2Grad",
        {"grad_expanded_x": grad, "expanded_row_idx": padded_idx},
        {
            "top_k": 3,
            "drop_pad_mode": 1,
        },
        "drop-pad",
    )
    tokens, rmap = normal(rng, (6, 5), BF16), routing_map(rng, 6, 4, 2)
    probs = normal(rng, (6, 4), np.float32)
    yield (
        "MoeTokenPermuteWithRoutingMap",
        {"tokens": tokens, "routing_map": rmap, "probs": probs},
        {"num_out_tokens": 12},
        "bf16-f32-probs",
    )
    yield (
        "MoeTokenPermuteWithRoutingMap",
        {
            "tokens": normal(rng, (6, 5), np.float32),
            "routing_map": routing_map(rng, 6, 4, 2, np.int8),
        },
        {"num_out_tokens": 8, "drop_and_pad": 1},
        "padded-int8-map",
    )
    sorted_indices = np.random.default_rng(2).permutation(12).astype(np.int32)
    yield (
        "MoeTokenPermuteWithRoutingMapGrad",
        {
            "permuted_tokens_grad": normal(rng, (12, 5), np.float32),
            "permuted_probs_grad": normal(rng, (12,), np.float32),
            "sorted_indices": sorted_indices,
            "routing_map": rmap,
        },
        {},
        "probs",
    )
    yield (
        "MoeTokenPermuteWithRoutingMapGrad",
        {
            "permuted_tokens_grad": normal(rng, (12, 5), np.float16),
            "permuted_probs_grad": None,
            "sorted_indices": sorted_indices,
        },
        {"tokens_num": 6},
        "no-map",
    )
    yield (
        "MoeTokenUnpermuteWithRoutingMap",
        {
            "permuted_tokens": normal(rng, (12, 5), BF16),
            "sorted_indices": sorted_indices,
            "routing_map": rmap,
            "probs": probs,
        },
        {},
        "bf16-f32-probs",
    )
    yield (
        "MoeTokenUnpermuteWithRoutingMap",
        {
            "permuted_tokens": normal(rng, (8, 5), np.float32),
            "sorted_indices": np.array([0, 3, -1, 1, 2, 5, 4, -1], np.int32),
        },
        {"padded_mode": 1, "restore_shape": [6, 5]},
        "padded",
    )
    yield (
        "MoeTokenUnpermuteWithRoutingMapGrad",
        {
            "unpermuted_tokens_grad": normal(rng, (6, 5), BF16),
            "out_index": sorted_indices,
            "permute_token_id": np.repeat(np.arange(6, dtype=np.int32), 2),
            "routing_map": rmap,
            "permuted_tokens": normal(rng, (12, 5), BF16),
            "probs": probs,
        },
        {},
        "probs",
    )
    logits = normal(rng, (2, 3, 8), BF16)
    yield ("MoeGatingTopKSoftmax", {"x": logits, "finished": rng.random((2, 3)) < 0.5}, {"k": 3}, "3d-bf16-finished")
    yield (
        "MoeGatingTopK",
        {"x": normal(rng, (5, 16), np.float32), "bias": normal(rng, (16,), np.float32)},
        {"k": 4, "k_group": 2, "group_count": 4, "group_select_mode": 1, "norm_type": 1, "routed_scaling_factor": 2.5},
        "grouped-sigmoid",
    )
    yield (
        "MoeGatingTopK",
        {
            "x": normal(rng, (5, 16), np.float16),
            "input_ids": np.array([0, 2, 1, 1, 0], np.int64),
            "tid2eid": rng.integers(0, 16, (3, 2)).astype(np.int32),
        },
        {"k": 2, "norm_type": 2},
        "hash-fp16",
    )
    yield (
        "MoeGatingTopKBackward",
        {
            "x_norm": rng.random((5, 16)).astype(np.float32),
            "grad_y": normal(rng, (5, 4), BF16),
            "expert_idx": rng.integers(0, 16, (5, 4)).astype(np.int32),
        },
        {"routed_scaling_factor": 2.5},
        "bf16",
    )

    ids = rng.integers(0, 5, (6, 3)).astype(np.int64)
    yield ("MoeTokenPermute", {"tokens": normal(rng, (6, 5), BF16), "indices": ids}, {"num_out_tokens": -4}, "cut")
    permute_index = np.random.default_rng(3).permutation(18).astype(np.int32)
    yield (
        "MoeTokenPermuteGrad",
        {"permuted_output_grad": normal(rng, (14, 5), np.float16), "sorted_indices": permute_index},
        {"num_topk": 3},
        "cut",
    )
    unpermute_probs = normal(rng, (6, 3), np.float32)
    yield (
        "MoeTokenUnpermute",
        {"permuted_tokens": normal(rng, (14, 5), BF16), "sorted_indices": permute_index, "probs": unpermute_probs},
        {},
        "bf16-f32-probs",
    )
    yield (
        "MoeTokenUnpermuteGrad",
        {
            "permuted_tokens": normal(rng, (14, 5), BF16),
            "unpermuted_tokens_grad": normal(rng, (6, 5), BF16),
            "sorted_indices": permute_index,
            "probs": unpermute_probs,
        },
        {},
        "probs",
    )
    yield (
        "MoeTokenUnpermuteGrad",
        {
            "permuted_tokens": None,
            "unpermuted_tokens_grad": normal(rng, (18, 5), np.float32),
            "sorted_indices": permute_index,
        },
        {"permuted_tokens_num": 20},
        "no-probs",
    )
    v1_ids = rng.integers(0, 4, (5, 2)).astype(np.int32)
    yield (
        "MoeInitRouting",
        {
            "x": normal(rng, (5, 6), np.float16),
            "row_idx": np.arange(10, dtype=np.int32).reshape(2, 5).T.copy(),
            "expert_idx": v1_ids,
        },
        {"active_num": 3},
        "active",
    )
    yield (
        "MoeComputeExpertTokens",
        {"sorted_experts": np.sort(v1_ids.reshape(-1))},
        {"num_experts": 3},
        "sentinel",
    )
    yield (
        "GroupedMatmul",
        {
            "x": normal(rng, (9, 5), BF16),
            "weight": normal(rng, (3, 4, 5), BF16),
            "bias": normal(rng, (3, 4), np.float32),
            "group_list": np.array([3, 0, 4], np.int64),
        },
        {"group_type": 0, "group_list_type": 1, "transpose_weight": 1},
        "bf16-bias-counts-transposed",
    )
    yield (
        "GroupedMatmul",
        {
            "x": normal(rng, (6, 10), np.float32),
            "weight": normal(rng, (10, 4), np.float32),
            "group_list": np.array([4, 10], np.int64),
        },
        {"group_type": 2},
        "split-k",
    )
    yield ("SwiGlu", {"x": normal(rng, (3, 6, 4), BF16)}, {"dim": 1}, "bf16-dim1")
    yield ("SwiGluGrad", {"y_grad": normal(rng, (4, 3), np.float32), "x": normal(rng, (4, 6), np.float32)}, {}, "f32")
    slots = np.random.default_rng(2).permutation(10).astype(np.int32)
    yield (
        "MoeFinalizeRoutingV2",
        {
            "expanded_x": normal(rng, (10, 4), BF16),
            "expanded_row_idx": slots,
            "x1": normal(rng, (5, 4), BF16),
            "bias": normal(rng, (3, 4), BF16),
            "scales": normal(rng, (5, 2), np.float32),
            "expert_idx": rng.integers(0, 3, (5, 2)).astype(np.int32),
        },
        {"drop_pad_mode": 2},
        "bf16-skip-bias-f32-scales",
    )
    yield (
        "MoeFinalizeRoutingV2",
        {"expanded_x": normal(rng, (3, 4, 4), np.float32), "expanded_row_idx": np.array([0, 5, -1, 7], np.int32)},
        {"drop_pad_mode": 1, "k": 2},
        "column-padded-no-scales",
    )
    yield (
        "MoeFinalizeRoutingV2Grad",
        {
            "grad_y": normal(rng, (5, 4), np.float32),
            "expanded_row_idx": slots,
            "expanded_x": normal(rng, (10, 4), np.float32),
            "scales": normal(rng, (5, 2), np.float32),
        },
        {},
        "scales",
    )


CASES = list(cases())


@pytest.mark.parametrize("op_type, inputs, attrs", [c[:3] for c in CASES], ids=[f"{c[0]}-{c[3]}" for c in CASES])
def test_function_equals_the_session_node_bit_for_bit(op_type, inputs, attrs):
    op = OPS[op_type]
    function = getattr(mt, snake_case(op_type))
    tensors = [None if inputs.get(i.name) is None else to_torch(inputs[i.name]) for i in op.inputs]
    got = function(*tensors, **attrs)
    got = got if isinstance(got, tuple) else (got,)
    names = [decl.name if value is not None else "" for decl, value in zip(op.outputs, got)]
    want = iter(run_node(op_type, inputs, attrs, outputs=names))
    for decl, value in zip(op.outputs, got):
        if value is None:
            assert decl.optional, f"required output {decl.name} came back None"
        else:
            assert_same_bits(to_numpy(value), next(want), f"{op_type} output {decl.name}")


def test_every_op_has_a_function_whose_signature_is_the_opdef():
    assert set(mt.FUNCTIONS) == set(OPS)
    for name, op in OPS.items():
        function = getattr(mt, snake_case(name))
        parameters = inspect.signature(function).parameters
        assert list(parameters) == op.input_names + [a.name for a in op.attrs]
        for a in op.attrs:
            assert parameters[a.name].kind is inspect.Parameter.KEYWORD_ONLY
            assert parameters[a.name].default == (inspect.Parameter.empty if a.required else a.default)
        schema = function.overload._schema
        assert [r.type.kind() for r in schema.returns] == ["TensorType"] * len(op.outputs)
        assert [x.name for x in schema.arguments] == list(parameters)


def test_optional_outputs_come_back_none_exactly_when_absent():
    x = torch.randn(4, 3)
    expert_idx = torch.tensor([[0, 1], [1, 2], [2, 0], [0, 2]], dtype=torch.int32)
    _, _, counts, before = mt.moe_init_routing_v2(x, expert_idx, expert_num=3, expert_tokens_before_capacity_flag=1)
    assert counts is None and before.tolist() == [3, 2, 3]
    tokens, counts = torch.randn(3, 2), torch.tensor([[1, 2]])
    assert mt.moe_re_routing_v2(tokens, counts)[4] is None
    assert mt.moe_re_routing_v2(tokens, counts, expert_topk_weight=torch.ones(3, 1))[4].shape == (3, 1)


def test_bad_input_is_a_moe_op_error_eagerly_and_under_export():
    with pytest.raises(moe_onnx.MoeOpError, match=r"sum\(expert_token_num_per_rank\) must equal A"):
        mt.moe_re_routing_v2(torch.randn(5, 2), torch.tensor([[1, 2]]))

    class Mismatched(torch.nn.Module):
        def forward(self, x, expert_idx):
            return mt.moe_init_routing_v2(x, expert_idx)[0]

    with pytest.raises(moe_onnx.MoeOpError, match="must have the same T"):
        torch.export.export(Mismatched(), (torch.randn(4, 3), torch.zeros(5, 2, dtype=torch.int32)))


def test_export_traces_sizes_symbolically():
    """T*K rows follow a dynamic T; AllToAll's received rows are a new unbacked size."""

    class Layer(torch.nn.Module):
        def forward(self, x, expert_idx):
            expanded, row_idx, counts, _ = mt.moe_init_routing_v2(
                x, expert_idx, expert_num=4, expert_tokens_count_or_cumsum_flag=2
            )
            received, _ = mt.all_to_all(expanded, counts.to(torch.int64).view(2, 2).sum(1))
            return expanded, mt.moe_init_routing_v2_grad(expanded, row_idx, top_k=2), received

    tokens = torch.export.Dim("T")
    exported = torch.export.export(
        Layer(),
        (torch.randn(5, 3), torch.zeros(5, 2, dtype=torch.int32)),
        dynamic_shapes=({0: tokens}, {0: tokens}),
    )
    expanded, grad_x, received = (node.meta["val"] for node in exported.graph.find_nodes(op="output")[0].args[0])
    t = grad_x.shape[0]
    assert str(t) != "5" and expanded.shape[0] == 2 * t
    assert str(received.shape[0]).startswith("u")  # unbacked: depends on the counts


def test_compile_traces_forward_and_backward_into_cann_moe_ops():
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def keep(gm, example_inputs):
        graphs.append(str(gm.code))
        return gm

    def layer(x, expert_idx, routing_map, probs):
        expanded, row_idx, _, _ = mt.moe_init_routing_v2(x, expert_idx)
        return mt.moe_token_unpermute_with_routing_map(expanded * 2, row_idx, routing_map, probs)[0]

    compiled = torch.compile(layer, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep), fullgraph=True)
    rng = np.random.default_rng(0)
    rmap = torch.from_numpy(routing_map(rng, 5, 4, 2))
    expert_idx = torch.nonzero(rmap)[:, 1].view(5, 2).to(torch.int32)
    x, probs = torch.randn(5, 3, requires_grad=True), torch.rand(5, 4, requires_grad=True)
    compiled(x, expert_idx, rmap, probs).sum().backward()
    forward, backward = graphs
    assert "cann_moe.moe_init_routing_v2.default" in forward
    assert "cann_moe.moe_token_unpermute_with_routing_map_grad.default" in backward
    assert "cann_moe.moe_init_routing_v2_grad.default" in backward
    x_eager, probs_eager = x.detach().clone().requires_grad_(), probs.detach().clone().requires_grad_()
    layer(x_eager, expert_idx, rmap, probs_eager).sum().backward()
    assert torch.equal(x.grad, x_eager.grad) and torch.equal(probs.grad, probs_eager.grad)


def test_symbolic_attribute_is_refused_clearly():
    class Permute(torch.nn.Module):
        def forward(self, tokens, rmap):
            return mt.moe_token_permute_with_routing_map(tokens, rmap, num_out_tokens=tokens.shape[0] * 2)[0]

    tokens = torch.export.Dim("T")
    with pytest.raises(TypeError, match="num_out_tokens .* is symbolic; ONNX attributes are constants"):
        torch.export.export(
            Permute(),
            (torch.randn(4, 3), torch.ones(4, 2, dtype=torch.bool)),
            dynamic_shapes=({0: tokens}, {0: tokens}),
        )


def test_import_moe_onnx_does_not_import_torch():
    code = (
        "import sys, moe_onnx, moe_onnx.converters, moe_onnx.models, moe_onnx.ranks, moe_onnx.commands.launch;"
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.int8, torch.bool])
def test_tensors_cross_without_copies(dtype):
    tensor = torch.zeros(4, 3, dtype=dtype)
    array = to_numpy(tensor)
    assert array.ctypes.data == tensor.data_ptr() and array.shape == (4, 3)
    back = to_torch(array)
    assert back.data_ptr() == tensor.data_ptr() and back.dtype == dtype


def test_every_forward_op_is_differentiable():
    """A new forward op without a backward formula would silently not train: each has one, or
    is declared not differentiable (as in torch_npu), and then its backward refuses."""
    from moe_onnx.torch.autograd import _FORMULAS, NOT_DIFFERENTIABLE

    forward = {name for name in moe_onnx.OPS if not name.endswith(("Grad", "Backward"))}
    assert not set(_FORMULAS) & set(NOT_DIFFERENTIABLE)
    assert forward <= set(_FORMULAS) | set(NOT_DIFFERENTIABLE), sorted(forward - set(_FORMULAS))


def test_a_bool_is_an_int_attribute_of_a_torch_function():
    """SPEC-layer 1.18: torch_npu code passes ``padded_mode=False``; ``0.5`` stays refused."""
    tokens, sorted_indices = torch.randn(6, 4), torch.tensor([0, 3, 1, 4, 2, 5], dtype=torch.int32)
    as_bool = mt.moe_token_unpermute_with_routing_map(tokens, sorted_indices, padded_mode=False, restore_shape=[3, 4])
    as_int = mt.moe_token_unpermute_with_routing_map(tokens, sorted_indices, padded_mode=0, restore_shape=[3, 4])
    assert all(torch.equal(a, b) for a, b in zip(as_bool[:3], as_int[:3]))
    with pytest.raises(moe_onnx.MoeOpError, match="'padded_mode' must be an integer, got 0.5"):
        mt.moe_token_unpermute_with_routing_map(tokens, sorted_indices, padded_mode=0.5, restore_shape=[3, 4])


def test_compile_with_dynamic_ints_specializes_the_attributes():
    """torch.compile(dynamic=True) hands Python ints over as symbols: an attribute taken from an
    argument is made a constant of the graph (one graph per value), not a failed trace."""

    def gate(x, k):
        return mt.moe_gating_top_k_softmax(x, None, k=k)

    compiled = torch.compile(gate, backend="aot_eager", fullgraph=True, dynamic=True)
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(0))
    for k in (2, 3):
        assert all(torch.equal(a, b) for a, b in zip(compiled(x, k), gate(x, k)))
