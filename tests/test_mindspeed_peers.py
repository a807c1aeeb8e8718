"""MindSpeed's fused permute (``MoePermuteMaskMap`` / ``MoeUnpermuteMaskMap``) and grouped
matmul (``BF16GMMFunction``) run unchanged after ``install_stand_ins()`` (only MindSpeed's
configuration and other kernels stubbed: tests/mindspeed_peers.py): a training step's output
and gradients (x, probs, both weights) against a dense pure-torch MoE under torch's autograd,
float32 and bfloat16, the probabilities applied in the experts or by the unpermute.

Marked ``peers``: deselected by default; MindSpeed's files are copied at test time from
``$MINDSPEED`` (a checkout) or ``$MINDSPEED_GIT`` (a bare clone; default the workplace's
mirror), and einops must be installed. Without them the test fails saying so (it is never
skipped). Run in a subprocess: the stubs and the stand-in stay out of this process.
"""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.peers

TOLERANCE = {"float32": 2e-5, "bfloat16": 4e-2}

SCRIPT = r"""
import json, sys
from pathlib import Path
import torch
from tests.mindspeed_peers import grouped_mlp, install

install(Path(sys.argv[1]))
T, E, H, F, K = 13, 6, 8, 5, 2
results = {}
for dtype in (torch.float32, torch.bfloat16):
    for probs_in_experts in (True, False):
        g = torch.Generator().manual_seed(3)
        x = torch.randn(T, H, generator=g)
        scores = torch.softmax(torch.randn(T, E, generator=g), -1)
        top, ids = scores.topk(K, dim=-1)
        routing_map = torch.zeros(T, E, dtype=torch.bool).scatter(1, ids, True)
        probs = torch.zeros(T, E).scatter(1, ids, top / top.sum(-1, keepdim=True))
        w1 = torch.randn(E, H, 2 * F, generator=g) / H**0.5
        w2 = torch.randn(E, F, H, generator=g) / F**0.5
        cotangent = torch.randn(T, H, generator=g)

        def leaves(d):
            return [t.clone().to(d).requires_grad_() for t in (x, probs, w1, w2)]

        ours = leaves(dtype)
        y = grouped_mlp(ours[0], routing_map, ours[1], ours[2], ours[3], probs_in_experts)
        (y.float() * cotangent).sum().backward()
        ref = leaves(torch.float32)
        gate, up = torch.einsum("th,ehf->etf", ref[0], ref[2]).chunk(2, dim=-1)
        every = torch.einsum("etf,efh->eth", torch.nn.functional.silu(gate) * up, ref[3])  # [E, T, H]
        want = (every * ref[1].T.unsqueeze(-1)).sum(0)  # probs are 0 off the top-k
        (want * cotangent).sum().backward()

        def error(a, b):
            a, b = a.detach().float(), b.detach().float()
            return float((a - b).abs().max() / b.abs().max())

        key = f"{str(dtype).split('.')[-1]}_{'experts' if probs_in_experts else 'unpermute'}"
        results[key] = {
            "dtype_ok": y.dtype == dtype and y.shape == (T, H),
            "y": error(y, want),
            # the probabilities' gradient only where they were routed (off the map it is not defined)
            "grad_probs": error(ours[1].grad[routing_map], ref[1].grad[routing_map]),
            **{f"grad_{n}": error(ours[i].grad, ref[i].grad) for n, i in (("x", 0), ("w1", 2), ("w2", 3))},
        }
print(json.dumps(results))
"""


def test_mindspeed_fused_path_trains_like_the_dense_moe(tmp_path):
    from tests.cann_recipes import peer_sources, run_script
    from tests.mindspeed_peers import copy_mindspeed

    # einops: MindSpeed's backward imports it
    source_dir = peer_sources("MindSpeed", ("einops",), copy_mindspeed, tmp_path / "mindspeed")
    results = run_script(SCRIPT, str(source_dir))
    assert set(results) == {f"{d}_{p}" for d in TOLERANCE for p in ("experts", "unpermute")}
    for key, errors in results.items():
        assert errors.pop("dtype_ok"), key
        assert max(errors.values()) <= TOLERANCE[key.split("_")[0]], (key, errors)
    print(json.dumps(results, indent=1))
