"""The seeds' PyTorch examples run on a CPU after ``install_stand_ins()`` (SPEC-layer 1.18).

Each example is the seed's code as the seed prints it, executed as it stands, with only
``.npu()``, ``device="npu"`` and ``torch_npu.npu.set_device(0)`` removed (each removal is marked
with a comment) and every import line kept. Outputs are checked against references written
here from the seeds' formulas (never by calling our kernels). Seed 003's literal counts
(``torch.ones(16, 16)``: 256 rows for A = 16384) are refused by the sum rule; the runs that
check values replace only that line, by counts that sum to A (the seed's own note).
"""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch

import moe_onnx
import moe_onnx.torch as mt
from moe_onnx.torch.stand_ins import STAND_INS


@pytest.fixture
def stand_ins():
    """The stand-ins for one test, removed from sys.modules afterwards."""
    mt.install_stand_ins()
    yield
    for name in STAND_INS:
        sys.modules.pop(name, None)


def run_seed(code: str, seed: int = 0, **replace: str) -> dict:
    """Execute ``code`` (after replacing whole lines given as ``old=new``) and return its names."""
    code = textwrap.dedent(code)
    for old, new in replace.values() if replace else ():
        assert old in code, old
        code = code.replace(old, new)
    torch.manual_seed(seed)
    namespace: dict = {"__name__": "seed_example"}
    exec(compile(code, "<seed example>", "exec"), namespace)  # noqa: S102 - the seed's code, as printed
    return namespace


# --- seed 003: MoeReRoutingV2 -----------------------------------------------------------------

SEED_003_SINGLE_OP = """
    import torch
    import torch_npu
    import cann_ops_transformer

    tokens_num = 16384
    tokens_length = 7168
    rank_num = 16
    expert_num = 16
    tokens = torch.randint(low=-10, high=20, size=(tokens_num, tokens_length), dtype=torch.int8)  # .npu() removed
    expert_token_num_per_rank = torch.ones(rank_num, expert_num, dtype=torch.int32)  # .npu() removed
    per_token_scales = torch.randn(tokens_num, dtype=torch.float32)  # .npu() removed

    # 不传入 expert_topk_weight，permute_topk_weight 为空 tensor
    permute_tokens, permute_per_token_scales, permute_token_idx, expert_token_num, permute_topk_weight = \\
        cann_ops_transformer.moe_re_routing(tokens, expert_token_num_per_rank, per_token_scales=per_token_scales,
                                            expert_token_num_type=1, idx_type=0)

    # 传入 expert_topk_weight，permute_topk_weight 为有效数据
    expert_topk_weight = torch.randn(tokens_num, 1, dtype=torch.float32)  # .npu() removed
    permute_tokens, permute_per_token_scales, permute_token_idx, expert_token_num, permute_topk_weight = \\
        cann_ops_transformer.moe_re_routing(tokens, expert_token_num_per_rank, per_token_scales=per_token_scales,
                                            expert_topk_weight=expert_topk_weight, expert_token_num_type=1, idx_type=0)
"""

SEED_003_GRAPH_MODE = """
    import torch
    import torch.nn as nn
    import torch_npu
    import torchair as tng
    from torchair.configs.compiler_config import CompilerConfig
    import cann_ops_transformer

    config = CompilerConfig()
    config.experimental_config.keep_inference_input_mutations = True
    npu_backend = tng.get_npu_backend(compiler_config=config)

    class MoeReRoutingModel(nn.Module):
        def __init__(self):
            super().__init__()

        def forward(self, tokens, expert_token_num_per_rank, *, per_token_scales=None, expert_topk_weight=None,
                    expert_token_num_type=1, idx_type=0):
            return cann_ops_transformer.moe_re_routing(tokens, expert_token_num_per_rank,
                                                       per_token_scales=per_token_scales,
                                                       expert_topk_weight=expert_topk_weight,
                                                       expert_token_num_type=expert_token_num_type,
                                                       idx_type=idx_type)

    def main():
        tokens_num = 16384
        tokens_length = 7168
        rank_num = 16
        expert_num = 16
        tokens = torch.randint(low=-10, high=20, size=(tokens_num, tokens_length), dtype=torch.int8)  # .npu() removed
        expert_token_num_per_rank = torch.ones(rank_num, expert_num, dtype=torch.int32)  # .npu() removed
        per_token_scales = torch.randn(tokens_num, dtype=torch.float32)  # .npu() removed
        expert_topk_weight = torch.randn(tokens_num, 1, dtype=torch.float32)  # .npu() removed

        model = MoeReRoutingModel()  # .npu() removed
        model = torch.compile(model, backend=npu_backend, dynamic=False)
        permute_tokens, permute_per_token_scales, permute_token_idx, expert_token_num, permute_topk_weight = \\
            model(tokens, expert_token_num_per_rank, per_token_scales=per_token_scales,
                  expert_topk_weight=expert_topk_weight, expert_token_num_type=1, idx_type=0)

    if __name__ == '__main__':
        main()
"""

ONES = "expert_token_num_per_rank = torch.ones(rank_num, expert_num, dtype=torch.int32)"
# counts that sum to A = 16384 (seed 003: "each count > 0 and the sum must equal A")
SUMMING = (
    "expert_token_num_per_rank = torch.multinomial(torch.ones(rank_num * expert_num), tokens_num, "
    "replacement=True).bincount(minlength=rank_num * expert_num).view(rank_num, expert_num).to(torch.int32)"
)


def rerouting_reference(tokens, counts, *rows):
    """Seed 003's formula: block (rank r, expert e) moves from SrcOffset (rank-major) to DstOffset
    (expert-major); returns the moved ``tokens`` and ``rows``, the gather index, the counts."""
    ranks, experts = counts.shape
    src = {}
    offset = 0
    for r in range(ranks):
        for e in range(experts):
            src[r, e] = offset
            offset += int(counts[r, e])
    gather = torch.cat(
        [torch.arange(src[r, e], src[r, e] + int(counts[r, e])) for e in range(experts) for r in range(ranks)]
    )
    return [t[gather] for t in (tokens, *rows)], gather.to(torch.int32), counts.sum(0)


def test_seed_003_literal_counts_are_refused_by_the_sum_rule(stand_ins):
    rule = r"sum\(expert_token_num_per_rank\) must equal A = tokens.shape\[0\] = 16384, got 256"
    with pytest.raises(moe_onnx.MoeOpError, match=rule):
        run_seed(SEED_003_SINGLE_OP)


def test_seed_003_single_op_example(stand_ins):
    seen = run_seed(SEED_003_SINGLE_OP, counts=(ONES, SUMMING))
    counts = seen["expert_token_num_per_rank"]
    assert int(counts.sum()) == 16384 and (counts > 0).all()
    (tokens, scales, weight), gather, per_expert = rerouting_reference(
        seen["tokens"], counts, seen["per_token_scales"], seen["expert_topk_weight"]
    )
    assert torch.equal(seen["permute_tokens"], tokens) and seen["permute_tokens"].dtype == torch.int8
    assert torch.equal(seen["permute_per_token_scales"], scales)
    assert torch.equal(seen["permute_token_idx"], gather)
    assert torch.equal(seen["expert_token_num"], per_expert) and seen["expert_token_num"].dtype == torch.int32
    assert torch.equal(seen["permute_topk_weight"], weight)
    # the first call, without expert_topk_weight: the fifth output is an empty tensor
    import cann_ops_transformer

    first = cann_ops_transformer.moe_re_routing(seen["tokens"][:0], torch.zeros(2, 2, dtype=torch.int32))
    assert first[4].shape == (0,) and first[4].dtype == torch.float32


def test_seed_003_graph_mode_under_torch_compile(stand_ins):
    """The graph-mode model, compiled as the seed compiles it (inductor here): refused with the
    literal counts, and the eager bits (and the reference) with counts that sum to A."""
    with pytest.raises(moe_onnx.MoeOpError, match=r"must equal A = tokens.shape\[0\] = 16384, got 256"):
        run_seed(SEED_003_GRAPH_MODE)["main"]()
    seen = run_seed(SEED_003_GRAPH_MODE, counts=(ONES, SUMMING))
    seen["main"]()  # the seed's own run, as printed (with the line above replaced)
    torch.manual_seed(1)
    tokens = torch.randint(low=-10, high=20, size=(16384, 7168), dtype=torch.int8)
    counts = torch.multinomial(torch.ones(256), 16384, replacement=True).bincount(minlength=256)
    counts = counts.view(16, 16).to(torch.int32)
    scales, weight = torch.randn(16384), torch.randn(16384, 1)
    model = seen["MoeReRoutingModel"]()
    compiled = torch.compile(model, backend=seen["npu_backend"], dynamic=False)
    kwargs = dict(per_token_scales=scales, expert_topk_weight=weight, expert_token_num_type=1, idx_type=0)
    got, eager = compiled(tokens, counts, **kwargs), model(tokens, counts, **kwargs)
    assert all(torch.equal(g, e) for g, e in zip(got, eager))
    (want_tokens, want_scales, want_weight), gather, per_expert = rerouting_reference(tokens, counts, scales, weight)
    assert torch.equal(got[0], want_tokens) and torch.equal(got[1], want_scales) and torch.equal(got[4], want_weight)
    assert torch.equal(got[2], gather) and torch.equal(got[3], per_expert)


# --- seed 001: MoeInitRoutingV2Grad with the V4 forward ---------------------------------------

SEED_001_MANUAL = """
    import torch
    import torch_npu
    from cann_ops_transformer.ops import moe_init_routing, moe_init_routing_grad

    # torch_npu.npu.set_device(0)  (removed)

    n = 4
    h = 8
    k = 2
    expert_num = 8
    drop_pad_mode = 0
    expert_tokens_num_type = 1
    expert_tokens_num_flag = True
    quant_mode = -1
    active_expert_range = [0, 4]
    row_idx_type = 0

    x = torch.randn((n, h), dtype=torch.float32)  # device="npu" removed
    expert_idx = torch.randint(0, expert_num, (n, k), dtype=torch.int32)  # device="npu" removed

    # 正向
    expanded_x, expanded_row_idx, expert_tokens_count, expanded_scale, expanded_topk_weight = \\
        moe_init_routing(x, expert_idx, active_num=-1, expert_capacity=-1, expert_num=expert_num,
                         drop_pad_mode=drop_pad_mode, expert_tokens_num_type=expert_tokens_num_type,
                         expert_tokens_num_flag=expert_tokens_num_flag, quant_mode=quant_mode,
                         active_expert_range=active_expert_range, row_idx_type=row_idx_type)

    # 手动调用反向
    grad_expanded_x = torch.randn_like(expanded_x)
    grad_x = moe_init_routing_grad(grad_expanded_x, expanded_row_idx, top_k=k,
                                   drop_pad_mode=drop_pad_mode, active_num=0)
    print(grad_x.shape)  # torch.Size([4, 8])
"""

SEED_001_AUTOMATIC = """
    import torch
    import torch_npu
    from cann_ops_transformer.ops import moe_init_routing

    # torch_npu.npu.set_device(0)  (removed)

    n = 4
    h = 8
    k = 2
    expert_num = 8

    x = torch.randn((n, h), dtype=torch.float32, requires_grad=True)  # device="npu" removed
    expert_idx = torch.randint(0, expert_num, (n, k), dtype=torch.int32)  # device="npu" removed

    # 正向：x.requires_grad=True 时自动启用 autograd
    expanded_x, expanded_row_idx, expert_tokens_count, expanded_scale, expanded_topk_weight = \\
        moe_init_routing(x, expert_idx, active_num=-1, expert_capacity=-1, expert_num=expert_num,
                         drop_pad_mode=0, expert_tokens_num_type=1, expert_tokens_num_flag=True,
                         quant_mode=-1, active_expert_range=[0, 4], row_idx_type=0)

    # 反向：自动触发 moe_init_routing_grad
    loss = expanded_x.sum()
    loss.backward()
    print(x.grad.shape)  # torch.Size([4, 8])
"""


def routing_reference(x, expert_idx, start, end):
    """Seed 001 / SPEC-layer 1.17 with Python lists: rows of the in-range slots sorted by
    (expert, slot), zeros after them; slot -> row (-1 out of range); counts of the range."""
    top_k = expert_idx.shape[1]
    slots = [(int(e), p) for p, e in enumerate(expert_idx.reshape(-1).tolist()) if start <= e < end]
    slots.sort()
    expanded = torch.zeros(expert_idx.numel(), x.shape[1])
    row_of_slot = [-1] * expert_idx.numel()
    for d, (_, p) in enumerate(slots):
        expanded[d] = x[p // top_k]
        row_of_slot[p] = d
    counts = [sum(1 for e, _ in slots if e == expert) for expert in range(start, end)]
    return expanded, torch.tensor(row_of_slot, dtype=torch.int32), counts


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_seed_001_manual_backward(stand_ins, seed):
    seen = run_seed(SEED_001_MANUAL, seed)
    expanded, row_of_slot, counts = routing_reference(seen["x"], seen["expert_idx"], 0, 4)
    assert torch.equal(seen["expanded_x"], expanded) and torch.equal(seen["expanded_row_idx"], row_of_slot)
    assert seen["expert_tokens_count"].dtype == torch.int64 and seen["expert_tokens_count"].tolist() == counts
    assert seen["expanded_scale"].shape == (8,) and seen["expanded_topk_weight"].shape == (0,)
    grad = seen["grad_expanded_x"]
    want = torch.zeros(4, 8)
    for p, d in enumerate(row_of_slot.tolist()):  # seed 001's formula; -1 (an inactive expert) adds nothing
        if d >= 0:
            want[p // 2] += grad[d]
    assert seen["grad_x"].shape == (4, 8)
    torch.testing.assert_close(seen["grad_x"], want, rtol=0, atol=0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_seed_001_automatic_backward(stand_ins, seed):
    seen = run_seed(SEED_001_AUTOMATIC, seed)
    expanded, _, _ = routing_reference(seen["x"].detach(), seen["expert_idx"], 0, 4)
    assert torch.equal(seen["expanded_x"].detach(), expanded)
    in_range = ((seen["expert_idx"] >= 0) & (seen["expert_idx"] < 4)).sum(1).float()  # copies of each token
    assert torch.equal(seen["x"].grad, in_range[:, None].expand(4, 8))


@pytest.mark.parametrize(
    "backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)]
)  # inductor's first C++ build of this graph takes ~30 s (6 s from its cache)
def test_seed_001_forward_under_torch_compile_gives_the_eager_bits(stand_ins, backend):
    from cann_ops_transformer.ops import moe_init_routing

    def forward(x, expert_idx, topk_weight):
        return moe_init_routing(
            x, expert_idx, topk_weight=topk_weight, expert_num=8, expert_tokens_num_type=1,
            expert_tokens_num_flag=True, active_expert_range=[2, 6], row_idx_type=1,
        )  # fmt: skip

    torch.manual_seed(3)
    x, expert_idx, weight = torch.randn(6, 5), torch.randint(0, 8, (6, 3), dtype=torch.int32), torch.rand(6, 3)
    got, eager = torch.compile(forward, backend=backend)(x, expert_idx, weight), forward(x, expert_idx, weight)
    assert all(torch.equal(g, e) for g, e in zip(got, eager))
    flat = expert_idx.view(-1)
    order = torch.argsort(torch.where(flat < 2, 2**31 - 1, flat), stable=True)
    filled = int(((flat >= 2) & (flat < 6)).sum())
    assert torch.equal(eager[4][:filled, 0], weight.view(-1)[order[:filled]]) and not eager[4][filled:].any()


# --- seed 001 section 7's rules and section 9's NotImplementedError ----------------------------

G, IDX = torch.ones(6, 4), torch.tensor([4, 1, 5, 3, 0, 2], dtype=torch.int32)


@pytest.mark.parametrize(
    "args, kwargs, fragment",
    [
        ((torch.ones(3, 2, 4), IDX, 2), {}, "grad_expanded_x must be [A, H] in dropless mode"),
        ((G, IDX, 2), {"drop_pad_mode": 1}, "grad_expanded_x must be [E, C, H] in drop/pad mode"),
        ((G.double(), IDX, 2), {}, "input 'grad_expanded_x' has dtype float64"),
        ((G, IDX.view(3, 2), 2), {}, "input 'expanded_row_idx' must have rank 1"),
        ((G, IDX.long(), 2), {}, "input 'expanded_row_idx' has dtype int64"),
        ((G, IDX, 4), {}, "len(expanded_row_idx) = 6 must be divisible by top_k = 4"),
        ((G, IDX, 0), {}, "top_k must be > 0, got 0"),
        ((G, IDX, 2), {"drop_pad_mode": 2}, "attribute 'drop_pad_mode' must be one of [0, 1], got 2"),
        ((G, IDX, 2), {"active_num": -1}, "active_num must be >= 0, got -1"),
        ((G[:5], IDX, 2), {}, "dropless mode: grad_expanded_x dim 0 must equal len(expanded_row_idx)"),
        ((G, IDX, 2), {"active_num": 4}, "active mode: grad_expanded_x dim 0 must equal min(active_num"),
    ],
)
def test_seed_001_section_7_rules_are_moe_op_errors(stand_ins, args, kwargs, fragment):
    import cann_ops_transformer

    assert cann_ops_transformer.moe_init_routing_grad is cann_ops_transformer.ops.moe_init_routing_grad
    with pytest.raises(moe_onnx.MoeOpError) as info:
        cann_ops_transformer.moe_init_routing_grad(*args, **kwargs)
    assert fragment in str(info.value) and info.value.op_type == "MoeInitRoutingV2Grad"


@pytest.mark.parametrize(
    "kwargs, feature",
    [
        ({"topk_weight": torch.rand(4, 2)}, "topk_weight"),
        ({"scale": torch.ones(4)}, "scale"),
        ({"row_idx_type": 1}, "row_idx_type=1"),
    ],
)
def test_seed_001_section_9_not_implemented_names_the_feature(stand_ins, kwargs, feature):
    """(x_dtype names uint8 storage, which cannot require a gradient.)"""
    from cann_ops_transformer.ops import moe_init_routing

    x = torch.randn(4, 8, requires_grad=True)
    expanded_x, *_ = moe_init_routing(x, torch.zeros(4, 2, dtype=torch.int32), expert_num=2, **kwargs)
    with pytest.raises(NotImplementedError, match=f"no automatic backward when the forward uses {feature}"):
        expanded_x.sum().backward()


def test_seed_001_quantisation_is_refused_by_name(stand_ins):
    from cann_ops_transformer.ops import moe_init_routing

    x, expert_idx = torch.randn(4, 8), torch.zeros(4, 2, dtype=torch.int32)
    with pytest.raises(moe_onnx.MoeOpError, match="moe_init_routing: quant_mode=1 is not supported: int8 dynamic"):
        moe_init_routing(x, expert_idx, expert_num=2, quant_mode=1)
    with pytest.raises(moe_onnx.MoeOpError, match="moe_init_routing: offset=.* is not supported"):
        moe_init_routing(x, expert_idx, expert_num=2, offset=torch.ones(1))
    with pytest.raises(moe_onnx.MoeOpError, match=r"topk_weight must be \[T, K\]"):
        moe_init_routing(x, expert_idx, expert_num=2, topk_weight=torch.ones(4, 3))
