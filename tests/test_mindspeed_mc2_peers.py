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

Marked ``peers``: MindSpeed's files come from ``$MINDSPEED`` (a checkout) or ``$MINDSPEED_GIT``
(a bare clone; default the workplace's mirror); einops and megatron-core must be installed.
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


def run_ranks(source_dir: Path, world: int, ep_size: int, tmp_path: Path) -> list[dict]:
    """Start ``world`` interpreters on :data:`SCRIPT`; every rank's JSON, or an AssertionError
    with the failing ranks' error output."""
    root = Path(__file__).resolve().parent.parent
    init_file = tmp_path / f"gloo_{world}_{ep_size}"
    args = [str(source_dir), "", str(world), str(init_file), str(ep_size)]
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", SCRIPT, *args[:1], str(rank), *args[2:]],
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
    from tests.cann_recipes import SourceMissing
    from tests.mindspeed_mc2_peers import copy_mindspeed_mc2

    for needed in ("einops", "megatron.core"):
        try:
            __import__(needed)
        except ImportError as err:
            pytest.fail(f"the MindSpeed mc2 peers test needs {needed} installed: {err}")
    source_dir = tmp_path / "mindspeed"
    try:
        copy_mindspeed_mc2(source_dir)
    except SourceMissing as err:
        pytest.fail(f"the peers test needs MindSpeed's files: {err}")
    results = run_ranks(source_dir, world, ep_size, tmp_path)
    for rank, by_dtype in enumerate(results):
        assert set(by_dtype) == set(TOLERANCE), by_dtype
        for dtype, errors in by_dtype.items():
            assert errors.pop("dtype_ok"), (rank, dtype)
            assert errors.pop("routed") > 0, (rank, dtype)
            assert max(errors.values()) <= TOLERANCE[dtype], (rank, dtype, errors)
    print(json.dumps(results, indent=1))
