"""MindSpeed's mc2 expert path trains one step unchanged on gloo ranks: its ``AlltoallvPermuteGmm``
and ``GmmUnpermuteAlltoallv`` (``npu_alltoallv_gmm`` / ``npu_gmm_alltoallv`` forward and
backward, ``npu_grouped_matmul`` for dW) and ``fused_swiglu`` copied from MindSpeed and called
as ``GmmExpertsMC2Impl.forward`` does, inside Megatron's alltoall dispatcher
(tests/mindspeed_mc2_peers.py says what is stubbed: plumbing only). Against a Megatron-style
pure torch layer written here: the tokens and probabilities sent by
``torch.distributed.nn.functional.all_to_all_single``, one plain matmul pair per (source, local
expert) block, sent back and summed. Values and gradients (x, probs, both weights) on 2 and 4
ranks and on two 2-rank expert groups of a 4-rank world; float32 and bfloat16; rank 0 routes
nothing to rank 1's experts.

And the whole layer, unchanged: MindSpeed's ``AlltoAllMC2MoeLayer`` (router, its ``alltoall`` and
``alltoall_seq`` mc2 dispatchers, ``GmmExpertsMC2Impl``) on Megatron-LM core_v0.12.1 (copied from
its mirror, first on ``sys.path`` in the rank processes only), one training step on 2 and 4 ranks
against a Megatron-style torch layer: output and the gradients of the input, the router weight
and both expert weights on each rank.

Marked ``peers``: MindSpeed's files come from ``$MINDSPEED`` (a checkout) or ``$MINDSPEED_GIT``
(a bare clone; default the workplace's mirror), Megatron-LM's from ``$MEGATRON_LM`` /
``$MEGATRON_LM_GIT`` at core_v0.12.1; einops and megatron-core must be installed.
Without them the test fails saying so (never skipped). Each rank is its own interpreter, so
the stubs stay out of this process.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.peers

TOLERANCE = {"float32": 2e-5, "bfloat16": 4e-2}

SCRIPT = r"""
import json, sys
from datetime import timedelta
from pathlib import Path
import torch
import torch.distributed as dist
from tests.mindspeed_mc2_peers import install, mc2_moe

source_dir, init_file = sys.argv[1], sys.argv[4]
rank, world, ep_size = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[5])
torch.set_num_threads(1)
install(Path(source_dir))
dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                        timeout=timedelta(seconds=120))
groups = [dist.new_group(list(range(s, s + ep_size))) for s in range(0, world, ep_size)]
group = groups[rank // ep_size]
ep_rank = rank % ep_size
LOCAL, H, F, K = 2, 8, 5, 2
E = LOCAL * ep_size


def reference_moe(x, probs, routing_map, w1, w2):
    # Megatron-style pure torch: per expert the routed rows in token order, all-to-all-v by
    # destination, per (source, local expert) block x @ w1, silu(gate) * up * p, @ w2, back.
    import torch.distributed.nn.functional as dist_nn
    routed = [routing_map[:, e].nonzero().squeeze(1) for e in range(E)]
    send = torch.tensor([len(r) for r in routed]).reshape(ep_size, LOCAL)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv.view(-1), send.view(-1).clone(), group=group)
    rows = torch.cat([x[r] for r in routed])
    p = torch.cat([probs[r, e] for e, r in enumerate(routed)])
    to_me, from_me = recv.sum(1).tolist(), send.sum(1).tolist()
    in_rows = dist_nn.all_to_all_single(x.new_empty(sum(to_me), H), rows, to_me, from_me, group=group)
    in_p = dist_nn.all_to_all_single(p.new_empty(sum(to_me)), p, to_me, from_me, group=group)
    outs = []
    blocks = zip(in_rows.split(recv.view(-1).tolist()), in_p.split(recv.view(-1).tolist()))
    for (block, pb), (src, le) in zip(blocks, [(s, l) for s in range(ep_size) for l in range(LOCAL)]):
        gate, up = (block @ w1[le]).chunk(2, dim=-1)
        outs.append((torch.nn.functional.silu(gate) * up * pb[:, None]) @ w2[le])
    back = dist_nn.all_to_all_single(x.new_empty(sum(from_me), H), torch.cat(outs), from_me, to_me, group=group)
    return torch.zeros_like(x).index_add(0, torch.cat(routed), back)


results = {}
for dtype in (torch.float32, torch.bfloat16):
    g = torch.Generator().manual_seed(100 + rank)
    T = 7 + rank
    x = torch.randn(T, H, generator=g).to(dtype).float()
    scores = torch.randn(T, E, generator=g)
    if ep_rank == 0 and ep_size > 1:
        scores[:, LOCAL:2 * LOCAL] = -1e9  # nothing for the experts of the group's rank 1
    top, ids = torch.softmax(scores, -1).topk(K, dim=-1)
    routing_map = torch.zeros(T, E, dtype=torch.bool).scatter(1, ids, True)
    probs = torch.zeros(T, E).scatter(1, ids, top / top.sum(-1, keepdim=True))
    gw = torch.Generator().manual_seed(7 + rank // ep_size)
    mine = slice(ep_rank * LOCAL, (ep_rank + 1) * LOCAL)
    w1 = (torch.randn(E, H, 2 * F, generator=gw) / H**0.5)[mine].to(dtype).float()
    w2 = (torch.randn(E, F, H, generator=gw) / F**0.5)[mine].to(dtype).float()
    cotangent = torch.randn(T, H, generator=g)

    ours = [x.to(dtype), probs, w1.to(dtype), w2.to(dtype)]
    ours = [t.clone().requires_grad_() for t in ours]
    y = mc2_moe(ours[0], ours[1], routing_map, ours[2], ours[3], group)
    (y.float() * cotangent).sum().backward()
    ref = [t.clone().requires_grad_() for t in (x, probs, w1, w2)]
    want = reference_moe(ref[0], ref[1], routing_map, ref[2], ref[3])
    (want * cotangent).sum().backward()

    def error(a, b):
        a, b = a.detach().float(), b.detach().float()
        return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))

    results[str(dtype).split(".")[-1]] = {
        "dtype_ok": y.dtype == dtype and y.shape == (T, H) and all(t.grad.dtype == t.dtype for t in ours),
        "routed": int(routing_map.sum()),
        "y": error(y, want),
        "grad_x": error(ours[0].grad, ref[0].grad),
        "grad_probs": error(ours[1].grad[routing_map], ref[1].grad[routing_map]),
        "grad_w1": error(ours[2].grad, ref[2].grad),
        "grad_w2": error(ours[3].grad, ref[3].grad),
    }
dist.all_reduce(torch.zeros(1))  # a barrier (dist.barrier asks the renamed accelerator)
dist.destroy_process_group()
print(json.dumps(results))
"""


def run_ranks(source_dir: Path, world: int, ep_size: int | str, tmp_path: Path, script: str = SCRIPT) -> list[dict]:
    """Start ``world`` interpreters on ``script`` (arguments: the sources, the rank, ``world``, the
    rendezvous file, ``ep_size``); every rank's JSON, or an AssertionError with the failing ranks'
    error output."""
    root = Path(__file__).resolve().parent.parent
    init_file = tmp_path / f"gloo_{world}_{ep_size}"
    args = [str(source_dir), "", str(world), str(init_file), str(ep_size)]
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", script, *args[:1], str(rank), *args[2:]],
            cwd=root,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(world)
    ]
    outputs = []
    try:
        for rank in ranks:
            outputs.append(rank.communicate(timeout=300))
    finally:
        for rank in ranks:
            rank.kill()
    failed = [(r, err[-3000:]) for r, (rank, (_, err)) in enumerate(zip(ranks, outputs)) if rank.returncode != 0]
    assert not failed, failed
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]


@pytest.mark.parametrize(("world", "ep_size"), [(2, 2), (4, 4), (4, 2)])
def test_mindspeed_mc2_path_trains_like_megatron_style_torch(tmp_path, world, ep_size):
    from tests.cann_recipes import peer_sources
    from tests.mindspeed_mc2_peers import copy_mindspeed_mc2

    source_dir = peer_sources("MindSpeed mc2", ("einops", "megatron.core"), copy_mindspeed_mc2, tmp_path / "mindspeed")
    results = run_ranks(source_dir, world, ep_size, tmp_path)
    for rank, by_dtype in enumerate(results):
        assert set(by_dtype) == set(TOLERANCE), by_dtype
        for dtype, errors in by_dtype.items():
            assert errors.pop("dtype_ok"), (rank, dtype)
            assert errors.pop("routed") > 0, (rank, dtype)
            assert max(errors.values()) <= TOLERANCE[dtype], (rank, dtype, errors)
    print(json.dumps(results, indent=1))


LAYER_SCRIPT = r"""
import json, sys
from datetime import timedelta
from pathlib import Path
import torch
import torch.distributed as dist
from tests.mindspeed_mc2_peers import install_layer, mc2_layer

source_dir, rank, world, init_file = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
dispatcher_type = sys.argv[5]
torch.set_num_threads(1)
counts = install_layer(source_dir)
dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                        timeout=timedelta(seconds=120))
from megatron.core import parallel_state
import megatron.core

parallel_state.initialize_model_parallel(expert_model_parallel_size=world, create_gloo_process_groups=False)
H, F, E, K = 32, 64, 8, 2
LOCAL = E // world
S, B = 4 + rank, 2  # a different token count on each rank


def reference_layer(x, router_w, w1, w2, dtype):
    # Megatron-style pure torch on this rank's tokens with every expert's weights (float32):
    # logits = x Wr^T; the top-k of the logits as the layer's dtype computes them; softmax over the
    # k scores; per expert the routed tokens x @ w1[e], silu(gate) * up * p, @ w2[e], summed.
    tokens = x.reshape(-1, H)
    logits = tokens @ router_w.T
    with torch.no_grad():
        ids = (tokens.to(dtype) @ router_w.to(dtype).T).topk(K, dim=-1).indices
    probs = torch.softmax(logits.gather(1, ids), dim=-1)
    out = torch.zeros_like(tokens)
    for e in range(E):
        rows, slot = (ids == e).nonzero(as_tuple=True)
        gate, up = (tokens[rows] @ w1[e]).chunk(2, dim=-1)
        out = out.index_add(0, rows, (torch.nn.functional.silu(gate) * up * probs[rows, slot, None]) @ w2[e])
    routing_map = torch.zeros(tokens.shape[0], E, dtype=torch.bool).scatter(1, ids, True)
    return out.reshape(x.shape), routing_map


results = {"megatron_core": megatron.core.__file__}
for dtype in (torch.float32, torch.bfloat16):
    layer = mc2_layer(dict(moe_token_dispatcher_type=dispatcher_type, hidden_size=H, ffn_hidden_size=F,
                           moe_ffn_hidden_size=F, num_moe_experts=E,
                           moe_router_topk=K, expert_model_parallel_size=world, moe_router_load_balancing_type="none",
                           params_dtype=dtype, bf16=dtype == torch.bfloat16))
    layer.train()
    gw = torch.Generator().manual_seed(7)  # the same weights on every rank
    router_w = (torch.randn(E, H, generator=gw) / H**0.5).to(dtype).float()
    w1 = (torch.randn(E, H, 2 * F, generator=gw) / H**0.5).to(dtype).float()
    w2 = (torch.randn(E, F, H, generator=gw) / F**0.5).to(dtype).float()
    mine = slice(rank * LOCAL, (rank + 1) * LOCAL)
    with torch.no_grad():  # GroupedMLP's weights as GmmExpertsMC2Impl views them: [E_l, H, 2F], [E_l, F, H]
        layer.router.weight.copy_(router_w)
        layer.experts.weight1.copy_(w1[mine].reshape(H, -1))
        layer.experts.weight2.copy_(w2[mine].reshape(-1, H))
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(S, B, H, generator=g).to(dtype).float()
    cotangent = torch.randn(S, B, H, generator=g)

    before = dict(counts)
    x_in = x.to(dtype).clone().requires_grad_()
    y, bias = layer(x_in)
    (y.float() * cotangent).sum().backward()
    calls = {name: counts[name] - before[name] for name in counts}

    ref = [t.detach().clone().requires_grad_() for t in (x, router_w, w1, w2)]
    want, want_map = reference_layer(*ref, dtype)
    (want * cotangent).sum().backward()
    for grad in (ref[2].grad, ref[3].grad):  # each expert's gradient: every rank's tokens
        dist.all_reduce(grad)

    def error(a, b):
        a, b = a.detach().float(), b.detach().float()
        return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))

    results[str(dtype).split(".")[-1]] = {
        "layer": type(layer).__name__,
        "dispatcher": type(layer.token_dispatcher).__name__,
        "experts": type(layer.experts).__name__,
        "calls": calls,
        "bias_none": bias is None,
        "same_routing": bool(torch.equal(layer.token_dispatcher.routing_map, want_map)),
        "dtypes_ok": y.dtype == dtype and y.shape == x.shape and x_in.grad.dtype == dtype
        and all(p.grad.dtype == dtype for p in layer.parameters()),
        "routed_here": [int(c) for c in want_map[:, mine].sum(0)],
        "y": error(y, want),
        "grad_x": error(x_in.grad, ref[0].grad),
        "grad_router": error(layer.router.weight.grad, ref[1].grad),
        "grad_w1": error(layer.experts.weight1.grad.view(LOCAL, H, 2 * F), ref[2].grad[mine]),
        "grad_w2": error(layer.experts.weight2.grad.view(LOCAL, F, H), ref[3].grad[mine]),
    }
dist.all_reduce(torch.zeros(1))  # a barrier (dist.barrier asks the renamed accelerator)
dist.destroy_process_group()
print(json.dumps(results))
"""


MC2_DISPATCHERS = {  # moe_token_dispatcher_type -> the dispatcher AlltoAllMC2MoeLayer builds
    "alltoall": "MoEAlltoAllMC2TokenDispatcherAdaptor",
    "alltoall_seq": "MoEAlltoAllSEQMC2TokenDispatcherAdaptor",
}


@pytest.mark.parametrize("dispatcher", list(MC2_DISPATCHERS))
@pytest.mark.parametrize("world", [2, 4])
def test_mindspeed_mc2_layer_trains_like_megatron_style_torch(tmp_path, world, dispatcher):
    """MindSpeed's whole mc2 MoE layer, built by Megatron core_v0.12.1's ``MoELayer`` after
    MindSpeed's own feature patches, one training step on ``world`` gloo ranks (expert parallel
    size = world, 8 experts, top-2, H 32, FFN 64): output and the gradients of the input, the
    router weight and both expert weights on each rank, float32 and bfloat16.

    Run unchanged: MindSpeed HEAD's ``mindspeed/`` (``AlltoAllMC2MoeLayer`` via
    ``MindSpeedAlltoAllMC2MoeLayerAdaptor``, ``MoEAlltoAllMC2TokenDispatcher``,
    ``GmmExpertsMC2Impl``, ``mc2_fuse_a2a``, ``fused_swiglu``, ``AsyncAllToAllWithBackward``,
    the feature patches of ``GroupedMatmulFeature``, ``MoEAlltoAllMC2Feature`` and
    ``RequirementsBasicFeature``'s ``torch.compile`` -> ``dummy_compile``), and Megatron-LM
    core_v0.12.1's ``megatron/core`` (TopKRouter, the alltoall dispatcher's base, GroupedMLP's
    weights and ``activation_func_with_probs``, ``permute`` / ``unpermute``, parallel_state on gloo).

    Plumbing (tests/mindspeed_mc2_peers.py, ``install`` and ``install_layer``), no arithmetic:
    torch_npu = ``moe_onnx.torch.install_stand_ins()``; the ``npu`` device name (privateuse1
    renamed, as importing torch_npu does); ``ProcessGroup._get_backend(npu).get_hccl_comm_name``
    -> a name registered for the gloo group with ``register_group``; ``torch.cuda.current_device``
    -> the CPU, ``torch.cuda.Stream`` / ``current_stream`` / ``stream`` -> streams that do nothing;
    ``torch_npu.npu`` with ``_lazy_call`` and ``device`` (imported by MindSpeed's RNG tracker),
    ``torch_npu.__file__`` (MindSpeed's op builders read its folder at import);
    ``torchair.ge`` / ``torchair.ge_concrete_graph`` as no-op modules (GE graph converters
    registered at import); Megatron's ``maybe_move_tensor_to_cpu`` returns the splits as numpy
    without a copy (on the device it copies them to the host); the three modules of MindSpeed's
    overlap feature (incompatible with mc2) as empty classes, since ``moe_feature/adaptor.py``
    imports them and they need transformer_engine; Megatron's training args with
    ``recompute_activation_function=False`` and MindSpeed's two overlap flags off on the config.
    """
    from tests.cann_recipes import peer_sources
    from tests.mindspeed_mc2_peers import copy_layer_sources

    source_dir = peer_sources("MindSpeed mc2 layer", ("einops",), copy_layer_sources, tmp_path / "sources")
    results = run_ranks(source_dir, world, dispatcher, tmp_path, script=LAYER_SCRIPT)
    for rank, result in enumerate(results):
        assert result.pop("megatron_core") == str(source_dir / "megatron" / "core" / "__init__.py"), rank
        assert set(result) == set(TOLERANCE), result
        for dtype, errors in result.items():
            assert errors.pop("layer") == "MindSpeedAlltoAllMC2MoeLayerAdaptor", (rank, dtype)
            assert errors.pop("dispatcher") == MC2_DISPATCHERS[dispatcher], (rank, dtype)
            assert errors.pop("experts") == "MindSpeedGmmMC2Experts", (rank, dtype)
            # forward FC1 + FC2; backward each one's inverse; dW by a grouped matmul per weight
            calls = errors.pop("calls")
            assert calls["npu_alltoallv_gmm"] == 2 and calls["npu_gmm_alltoallv"] == 2, (rank, dtype, calls)
            assert calls["npu_grouped_matmul"] >= 2 and calls["npu_swiglu"] >= 1, (rank, dtype, calls)
            assert errors.pop("bias_none") and errors.pop("dtypes_ok"), (rank, dtype)
            assert errors.pop("same_routing"), (rank, dtype)
            assert sum(errors.pop("routed_here")) > 0, (rank, dtype)
            assert max(errors.values()) <= TOLERANCE[dtype], (rank, dtype, errors)
    print(json.dumps(results, indent=1))
