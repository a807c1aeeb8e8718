"""The torch side of expert compute and combine (SPEC-layer 1.8-1.10): the functions equal the
session's node, the gradients equal torch autograd of pure-torch references (float32 and
bfloat16), and torch_npu's names map their arguments (lists, transposed views, keywords) and
refuse by name what the CPU golden does not compute."""

from __future__ import annotations

import pytest
import torch

import moe_onnx
import moe_onnx.torch as mt
from moe_onnx.torch import npu
from moe_onnx.torch.arrays import to_numpy
from tests.support import assert_same_bits, run_node
from tests.torch_ep_layer import relative_error

TOLERANCE = {torch.float32: 1e-6, torch.bfloat16: 2e-2}
DTYPES = [torch.float32, torch.bfloat16]


def leaves(*tensors, dtype):
    return [None if t is None else t.to(dtype).detach().clone().requires_grad_() for t in tensors]


def check_gradients(ours_out, ref_out, ours_in, ref_in, dtype, seed=1):
    """Same outputs; after the same cotangent, the same input gradients."""
    assert relative_error(ours_out.float(), ref_out.float()) <= TOLERANCE[dtype]
    cotangent = torch.randn(ours_out.shape, generator=torch.Generator().manual_seed(seed)).to(ours_out.dtype)
    (ours_out * cotangent).sum().backward()
    (ref_out * cotangent).sum().backward()
    errors = [relative_error(a.grad.float(), b.grad.float()) for a, b in zip(ours_in, ref_in)]
    assert max(errors) <= TOLERANCE[dtype], errors


def generator(seed):
    return torch.Generator().manual_seed(seed)


# --- pure-torch references ---------------------------------------------------------------


def swiglu_reference(x, dim=-1):
    gate, up = x.float().chunk(2, dim=dim)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)


def grouped_reference(x, weight, bias, counts):
    """A per-group ``mm`` loop in float32 (rows past the groups: zeros)."""
    parts, start = [], 0
    for e, count in enumerate(counts):
        part = x[start : start + count].float() @ weight[e].float()
        parts.append(part if bias is None else part + bias[e].float())
        start += count
    rest = x.new_zeros(x.shape[0] - start, weight.shape[-1]).float()
    return torch.cat(parts + [rest]).to(x.dtype)


def finalize_reference(rows, index, scales, x1=None, x2=None, column=False):
    """y[i] = x1 + x2 + sum_j scales[i, j] * rows[index[p(i, j)]] (float32)."""
    tokens, top_k = scales.shape
    by_slot = index.long().view(top_k, tokens).T if column else index.long().view(tokens, top_k)
    flat = rows.reshape(-1, rows.shape[-1]).float()
    y = (flat[by_slot] * scales.float().unsqueeze(-1)).sum(1)
    for skip in (x1, x2):
        if skip is not None:
            y = y + skip.float()
    return y.to(rows.dtype)


# --- gradients ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dim", [-1, 0])
def test_swiglu_backward_is_swiglu_grad(dtype, dim):
    x = torch.randn(6, 8, generator=generator(0)) * 3
    (ours,), (ref,) = leaves(x, dtype=dtype), leaves(x, dtype=dtype)
    check_gradients(mt.swi_glu(ours, dim=dim), swiglu_reference(ref, dim), [ours], [ref], dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("transpose_weight", [0, 1])
@pytest.mark.parametrize("list_type", [0, 1])
def test_grouped_matmul_backward_in_x_weight_and_bias(dtype, transpose_weight, list_type):
    counts = [3, 0, 5, 2]  # 11 rows: the last one in no group
    x = torch.randn(11, 6, generator=generator(1))
    weight = torch.randn(4, 6, 5, generator=generator(2)) / 2
    bias = torch.randn(4, 5, generator=generator(3))
    group_list = torch.tensor(counts) if list_type else torch.tensor(counts).cumsum(0)
    x_ours, w_ours, x_ref, w_ref = *leaves(x, weight, dtype=dtype), *leaves(x, weight, dtype=dtype)
    (b_ours,), (b_ref,) = leaves(bias, dtype=torch.float32), leaves(bias, dtype=torch.float32)
    stored = w_ours.transpose(1, 2).contiguous() if transpose_weight else w_ours  # gradients flow to w_ours
    y = mt.grouped_matmul(
        x_ours, stored, b_ours, group_list, group_type=0, group_list_type=list_type, transpose_weight=transpose_weight
    )
    check_gradients(
        y, grouped_reference(x_ref, w_ref, b_ref, counts), [x_ours, w_ours, b_ours], [x_ref, w_ref, b_ref], dtype
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_grouped_matmul_backward_of_one_product(dtype):
    x, weight, bias = (
        torch.randn(7, 4, generator=generator(4)),
        torch.randn(4, 3, generator=generator(5)),
        torch.randn(3),
    )
    x_ours, w_ours, x_ref, w_ref = *leaves(x, weight, dtype=dtype), *leaves(x, weight, dtype=dtype)
    (b_ours,), (b_ref,) = leaves(bias, dtype=torch.float32), leaves(bias, dtype=torch.float32)
    y = mt.grouped_matmul(x_ours, w_ours, b_ours, group_type=-1)
    want = (x_ref.float() @ w_ref.float() + b_ref).to(dtype)
    check_gradients(y, want, [x_ours, w_ours, b_ours], [x_ref, w_ref, b_ref], dtype)


@pytest.mark.parametrize("counts", [[3, 0, 6], [3, 0, 5]], ids=["every-row", "a-row-past-the-groups"])
def test_grouped_matmul_with_bias_trains_under_torch_compile(counts):
    """gpt-oss's biased expert matmuls trained under torch.compile(dynamic=True): the bias
    gradient's sizes may not depend on the counts' values (a data-dependent size stops the
    tracing of the backward)."""

    def step(x, weight, bias, group_list):
        return npu.npu_grouped_matmul([x], [weight], bias=[bias], group_list=group_list, group_type=0, split_item=2)[0]

    inputs = [torch.randn(9, 5, generator=generator(1)), torch.randn(3, 5, 4) / 2, torch.randn(3, 4)]
    group_list = torch.tensor(counts).cumsum(0)
    eager, compiled = leaves(*inputs, dtype=torch.float32), leaves(*inputs, dtype=torch.float32)
    step(*eager, group_list).sum().backward()
    torch.compile(step, backend="aot_eager", fullgraph=True, dynamic=True)(*compiled, group_list).sum().backward()
    for a, b in zip(eager, compiled):
        assert torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-5)
    assert torch.equal(compiled[2].grad[1], torch.zeros(4))  # the empty group's bias


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", [0, 2, 3])
def test_finalize_routing_backward_in_rows_scales_and_skips(dtype, mode):
    tokens, top_k, hidden = 5, 2, 4
    g = generator(6)
    index = torch.randperm(tokens * top_k, generator=g).to(torch.int32)
    rows = torch.randn(tokens * top_k, hidden, generator=g)
    if mode == 3:  # drop/pad [E, C, H] with two dropped slots
        rows = torch.randn(4, 3, hidden, generator=g)
        index = torch.tensor([0, 5, -1, 7, 2, 11, -1, 3, 9, 1], dtype=torch.int32)
    scales, skip = torch.rand(tokens, top_k, generator=g), torch.randn(tokens, hidden, generator=g)
    ours, ref = leaves(rows, scales, skip, dtype=dtype), leaves(rows, scales, skip, dtype=dtype)
    y = mt.moe_finalize_routing_v2(ours[0], index, ours[2], None, None, ours[1], drop_pad_mode=mode)
    padded_rows = torch.cat([ref[0].reshape(-1, hidden), ref[0].new_zeros(1, hidden)])  # -1 reads a zero row
    safe = torch.where(index < 0, len(padded_rows) - 1, index)
    want = finalize_reference(padded_rows, safe, ref[1], ref[2], column=mode in (0, 1))
    check_gradients(y, want, ours, ref, dtype)


def test_bias_gradient_is_refused_by_name():
    rows, index = torch.randn(4, 2), torch.arange(4, dtype=torch.int32)
    bias = torch.randn(3, 2, requires_grad=True)
    y = mt.moe_finalize_routing_v2(
        rows, index, None, None, bias, None, torch.zeros(2, 2, dtype=torch.int32), drop_pad_mode=2, k=2
    )
    with pytest.raises(NotImplementedError, match="no gradient for bias"):
        y.sum().backward()


def test_gradients_are_deterministic():
    grads = []
    for _ in range(2):
        x = torch.randn(300, 64, generator=generator(7)).to(torch.bfloat16).requires_grad_()
        w = torch.randn(3, 64, 96, generator=generator(8)).to(torch.bfloat16).requires_grad_()
        y = mt.grouped_matmul(x, w, None, torch.tensor([100, 250, 300]), group_type=0)
        mt.swi_glu(y).float().sum().backward()
        grads.append((x.grad.view(torch.int16).clone(), w.grad.view(torch.int16).clone()))
    assert all(torch.equal(a, b) for a, b in zip(*grads))


# --- functions = nodes -------------------------------------------------------------------


def test_functions_equal_the_session_nodes_bit_for_bit():
    g = generator(9)
    x = torch.randn(6, 8, generator=g).to(torch.bfloat16)
    assert_same_bits(to_numpy(mt.swi_glu(x)), run_node("SwiGlu", {"x": to_numpy(x)})[0])
    weight = torch.randn(2, 8, 4, generator=g).to(torch.bfloat16)
    group_list = torch.tensor([2, 6])
    inputs = {"x": to_numpy(x), "weight": to_numpy(weight), "bias": None, "group_list": to_numpy(group_list)}
    assert_same_bits(
        to_numpy(mt.grouped_matmul(x, weight, None, group_list, group_type=0)),
        run_node("GroupedMatmul", inputs, {"group_type": 0})[0],
    )
    index = torch.randperm(6, generator=g).to(torch.int32)
    scales = torch.rand(3, 2, generator=g)
    got = mt.moe_finalize_routing_v2(x, index, None, None, None, scales, drop_pad_mode=2)
    node = {"expanded_x": to_numpy(x), "expanded_row_idx": to_numpy(index), "x1": None, "x2": None, "bias": None}
    assert_same_bits(
        to_numpy(got), run_node("MoeFinalizeRoutingV2", {**node, "scales": to_numpy(scales)}, {"drop_pad_mode": 2})[0]
    )


# --- torch_npu's names -------------------------------------------------------------------


def test_npu_grouped_matmul_maps_lists_and_views():
    g = generator(10)
    x = torch.randn(9, 4, generator=g)
    weights = [torch.randn(4, 3, generator=g) for _ in range(3)]
    counts = torch.tensor([2, 3, 4])
    want = grouped_reference(x, torch.stack(weights), None, counts.tolist())
    # E 2-D weights of one shape: stacked; a transposed view of the stack: no copy, same result
    (stacked,) = npu.npu_grouped_matmul([x], weights, group_list=counts, group_type=0, group_list_type=1, split_item=3)
    view = torch.stack([w.T for w in weights]).transpose(1, 2)
    (from_view,) = npu.npu_grouped_matmul([x], [view], group_list=counts, group_type=0, group_list_type=1, split_item=2)
    # (the view is read as its [N, K] rows, by the lane dots; the stack as [K, N], by the
    # few-rows kernel: two documented orders, equal to rounding)
    assert torch.allclose(stacked, want, atol=1e-6) and torch.allclose(from_view, want, atol=1e-6)
    # split_item 0/1: one tensor per group; a list of x concatenated, the output split back
    per_group = npu.npu_grouped_matmul([x], weights, group_list=counts.cumsum(0), group_type=0, split_item=0)
    assert [t.shape[0] for t in per_group] == [2, 3, 4] and torch.equal(torch.cat(per_group), stacked)
    pieces = list(torch.split(x, [2, 3, 4]))
    per_x = npu.npu_grouped_matmul(pieces, weights, group_type=0, split_item=1)
    assert all(torch.equal(a, b) for a, b in zip(per_x, per_group))
    # the List[int] overload: a cumsum, group_type may be left out
    (listed,) = npu.npu_grouped_matmul([x], weights, group_list=[2, 5, 9], split_item=3, tuning_config=[4])
    assert torch.equal(listed, stacked)


def test_npu_grouped_matmul_doc_example_of_independent_products():
    """op-plugin's doc: three x of different widths, group_type -1, split_item 0, with bias."""
    g = generator(11)
    xs = [torch.randn(256, 256, generator=g), torch.randn(1024, 256, generator=g), torch.randn(512, 1024, generator=g)]
    ws = [torch.randn(256, 256, generator=g), torch.randn(256, 1024, generator=g), torch.randn(1024, 128, generator=g)]
    bs = [torch.randn(256, generator=g), torch.randn(1024, generator=g), torch.randn(128, generator=g)]
    out = npu.npu_grouped_matmul(xs, ws, bias=bs, group_list=None, split_item=0, group_type=-1)
    for y, x, w, b in zip(out, xs, ws, bs):
        assert relative_error(y, x @ w + b) <= 1e-6


def test_npu_grouped_matmul_split_k_gives_per_group_products():
    g = generator(12)
    x, dy = torch.randn(10, 3, generator=g), torch.randn(10, 4, generator=g)
    (dw,) = npu.npu_grouped_matmul([x.t()], [dy], group_list=torch.tensor([4, 10]), group_type=2, split_item=3)
    want = torch.stack([x[:4].T @ dy[:4], x[4:].T @ dy[4:]])
    assert dw.shape == (2, 3, 4) and relative_error(dw, want) <= 1e-6


@pytest.mark.parametrize(
    "changes, argument",
    [
        ({"scale": [torch.ones(3)]}, "scale"),
        ({"per_token_scale": [torch.ones(9)]}, "per_token_scale"),
        ({"act_type": 5}, "act_type"),
        ({"group_list_type": 2}, "group_list_type"),
        ({"x_dtype": 1}, "x_dtype"),
        ({"weight_dtype": 1}, "weight_dtype"),
        ({"output_dtype": torch.float16}, "output_dtype"),
        ({"group_type": None}, "group_type"),
    ],
)
def test_npu_grouped_matmul_refuses_by_name(changes, argument):
    arguments = {"group_list": torch.tensor([9]), "group_type": 0, "split_item": 3, **changes}
    with pytest.raises(moe_onnx.MoeOpError, match=f"torch_npu.npu_grouped_matmul: {argument}=.* is not supported"):
        npu.npu_grouped_matmul([torch.randn(9, 4)], [torch.randn(1, 4, 3)], **arguments)


@pytest.mark.parametrize("split_item", [4, -1])
def test_npu_grouped_matmul_split_item_outside_0_to_3_is_an_error(split_item):
    """SPEC-layer 1.9 (c): split_item not in 0..3 is an error (it was read as 0)."""
    with pytest.raises(
        moe_onnx.MoeOpError,
        match=f"GroupedMatmul: torch_npu.npu_grouped_matmul: split_item must be 0, 1, 2 or 3, got {split_item}",
    ):
        npu.npu_grouped_matmul(
            [torch.randn(9, 4)],
            [torch.randn(1, 4, 3)],
            group_list=torch.tensor([9]),
            group_type=0,
            split_item=split_item,
        )


@pytest.mark.parametrize(
    "xs, ws",
    [
        ([torch.randn(2, 3, 5), torch.randn(4, 5)], [torch.randn(5, 4), torch.randn(5, 4)]),
        ([torch.randn(2, 5), torch.randn(4, 5)], [torch.randn(5, 4), torch.randn(5, 2)]),
    ],
    ids=["a-3d-x", "two-n"],
)
def test_npu_grouped_matmul_independent_products_in_one_tensor_need_one_row_layout(xs, ws):
    """group_type -1, split_item 3: products that cannot be concatenated along rows are a
    MoeOpError naming the rule, not torch.cat's RuntimeError."""
    with pytest.raises(moe_onnx.MoeOpError, match="each x must be 2-D and every weight have one N"):
        npu.npu_grouped_matmul(xs, ws, group_type=-1, split_item=3)


def test_npu_grouped_matmul_refuses_quantised_and_mismatched_weights():
    with pytest.raises(moe_onnx.MoeOpError, match="x=.*int8.* is not supported"):
        npu.npu_grouped_matmul(
            [torch.ones(2, 4, dtype=torch.int8)], [torch.ones(1, 4, 3, dtype=torch.int8)], group_type=0
        )
    with pytest.raises(moe_onnx.MoeOpError, match="weight=.*torch.int32.*FRACTAL_NZ"):
        npu.npu_grouped_matmul([torch.ones(2, 4)], [torch.ones(1, 4, 3, dtype=torch.int32)], group_type=0)
    with pytest.raises(moe_onnx.MoeOpError, match="grouped weights must have one 2-D shape"):
        npu.npu_grouped_matmul(
            [torch.ones(2, 4)], [torch.ones(4, 3), torch.ones(4, 5)], group_list=torch.tensor([1, 2]), group_type=0
        )


def test_npu_format_cast_is_a_logical_no_op_that_remembers_the_format():
    w = torch.randn(2, 3, 4)
    assert npu.npu_format_cast(w, 2) is w  # already ND
    nz = npu.npu_format_cast(w, 29)
    assert nz is not w and torch.equal(nz, w) and nz.data_ptr() == w.data_ptr()
    assert npu.get_npu_format(nz) == 29 and npu.get_npu_format(w) == 2
    assert npu.get_npu_format(torch.zeros(1, 2, 3, 4)) == 0  # NCHW: the base format of 4-D
    assert npu.get_npu_format(npu.npu_format_cast(w, npu.Format.NC1HWC0)) == 3
    assert npu.npu_format_cast_(w, 29) is w and npu.get_npu_format(w) == 29
    assert npu.get_npu_format(npu.npu_format_cast_(torch.ones(2), nz)) == 29  # the format of a tensor
    assert npu.get_npu_format(npu.npu_format_cast(w, 29, customize_dtype=torch.float16)) == 29
    with pytest.raises(moe_onnx.MoeOpError, match="npu_format_cast: acl_format=28 is not a torch_npu format"):
        npu.npu_format_cast(w, 28)
    # a grouped matmul reads the logical values whatever the format
    x, group_list = torch.randn(5, 3), torch.tensor([2, 5])
    got = npu.npu_grouped_matmul([x], [npu.npu_format_cast(w, 29)], group_list=group_list, group_type=0)
    assert torch.equal(got[0], npu.npu_grouped_matmul([x], [w], group_list=group_list, group_type=0)[0])


def test_npu_swiglu_and_backward():
    x = torch.randn(4, 6, generator=generator(13), requires_grad=True)
    y = npu.npu_swiglu(x)
    assert torch.equal(y, mt.swi_glu(x))
    y.sum().backward()
    assert torch.equal(x.grad, npu.npu_swiglu_backward(torch.ones(4, 3), x.detach()))


def test_npu_moe_finalize_routing_keywords():
    """cann-recipes-infer's call (yaml keyword export_for_source_row), the doc's keyword, and
    the doc's positional order."""
    g = generator(14)
    rows, index = torch.randn(6, 3, generator=g), torch.randperm(6, generator=g).to(torch.int32)
    scales, skip = torch.rand(3, 2, generator=g), torch.randn(3, 3, generator=g)
    want = finalize_reference(rows, index, scales, skip)
    got = npu.npu_moe_finalize_routing(
        rows, skip1=skip, skip2=None, bias=None, scales=scales, expanded_src_to_dst_row=index,
        export_for_source_row=None, drop_pad_mode=2,
    )  # fmt: skip
    assert relative_error(got, want) <= 1e-6
    doc = npu.npu_moe_finalize_routing(
        rows, skip, None, None, scales, index, expert_for_source_row=None, drop_pad_mode=2
    )
    assert torch.equal(doc, got)
    positional = npu.npu_moe_finalize_routing(rows, skip, None, None, scales, index, None, 2)
    assert torch.equal(positional, got)
    with pytest.raises(
        moe_onnx.MoeOpError, match="npu_moe_finalize_routing.*missing required argument 'export_for_source_row'"
    ):
        npu.npu_moe_finalize_routing(rows, skip, None, None, scales, index)
