"""LLaMA-Factory's NPU fused MoE kernel run unchanged after ``install_stand_ins()`` (only its
plugin registry and helpers stubbed: tests/llamafactory_peers.py), float32 and bfloat16:

* ``NpuFusedMoEKernel._apply(model=...)`` on a one-layer Qwen3-MoE causal LM of the installed
  transformers (v5: its ``Qwen3MoeExperts`` patched with ``NpuMoeFusedV5.experts_forward``):
  a training step's loss, logits and every parameter's gradient against the same model
  unpatched (transformers' pure-torch experts);
* ``NpuMoeFusedV4.sparse_block_forward`` on a v4-style list-backed block: output and
  gradients (x, every expert weight, the gate) against a dense pure-torch MoE.

Marked ``peers``: deselected by default; LLaMA-Factory's file is copied at test time from
``$LLAMA_FACTORY`` (a checkout) or ``$LLAMA_FACTORY_GIT`` (a bare clone; default the
workplace's mirror). Without it the test fails saying so (it is never skipped). Run in a
subprocess: the stubs and the stand-in stay out of this process.
"""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.peers

TOLERANCE = {"float32": 2e-5, "bfloat16": 4e-2}

SCRIPT = r"""
import copy, json, sys
from pathlib import Path
import torch
from tests.llamafactory_peers import V4SparseBlock, install

kernel = install(Path(sys.argv[1]))
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

def error(a, b):
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))

results = {}
for dtype in (torch.float32, torch.bfloat16):
    name = str(dtype).split(".")[-1]
    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=64, hidden_size=16, intermediate_size=24, moe_intermediate_size=8, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_experts=6, num_experts_per_tok=2,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=64,
    )
    reference = Qwen3MoeForCausalLM(config).to(dtype)
    with torch.no_grad():
        for p in reference.parameters():
            p.copy_(torch.randn(p.shape) * 0.2)
    patched = kernel.NpuFusedMoEKernel._apply(model=copy.deepcopy(reference))
    experts = [m for m in patched.modules() if type(m).__name__ == "Qwen3MoeExperts"]
    assert experts and all("forward" in vars(m) for m in experts), "no module was patched"
    ids = torch.randint(0, 64, (2, 11), generator=torch.Generator().manual_seed(1))
    outputs = {}
    for label, model in (("patched", patched), ("reference", reference)):
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        outputs[label] = (out.loss, out.logits, {n: p.grad for n, p in model.named_parameters()})
    (loss, logits, grads), (want_loss, want_logits, want_grads) = outputs["patched"], outputs["reference"]
    results[f"v5_causal_lm_{name}"] = {
        "loss": error(loss, want_loss), "logits": error(logits, want_logits),
        "grads": max(error(grads[n], want_grads[n]) for n in want_grads),
        "dtype_ok": float(logits.dtype == want_logits.dtype),
    }

    block = V4SparseBlock(16, 8, 6, 2).to(dtype)
    x = torch.randn(1, 13, 16, generator=torch.Generator().manual_seed(2)).to(dtype).requires_grad_()
    y, router_logits = kernel.NpuMoeFusedV4.sparse_block_forward(block, x)
    cotangent = torch.randn(y.shape, generator=torch.Generator().manual_seed(3))
    (y.float() * cotangent).sum().backward()
    reference_block = V4SparseBlock(16, 8, 6, 2)
    x_ref = x.detach().float().requires_grad_()
    want = reference_block.dense(x_ref)
    (want * cotangent).sum().backward()
    own, ref = dict(block.named_parameters()), dict(reference_block.named_parameters())
    results[f"v4_sparse_block_{name}"] = {
        "y": error(y, want), "grad_x": error(x.grad, x_ref.grad),
        "grads": max(error(own[n].grad, ref[n].grad) for n in ref),
        "dtype_ok": float(y.dtype == dtype and y.shape == x.shape),
    }
print(json.dumps(results))
"""


def test_llamafactory_npu_fused_moe_trains_like_torch(tmp_path):
    from tests.cann_recipes import SourceMissing, run_script
    from tests.llamafactory_peers import copy_llamafactory

    source_dir = tmp_path / "llamafactory"
    try:
        copy_llamafactory(source_dir)
    except SourceMissing as err:
        pytest.fail(f"the peers test needs LLaMA-Factory's file: {err}")
    results = run_script(SCRIPT, str(source_dir))
    assert set(results) == {f"{case}_{d}" for case in ("v5_causal_lm", "v4_sparse_block") for d in TOLERANCE}
    for key, errors in results.items():
        assert errors.pop("dtype_ok") == 1.0, key
        assert max(errors.values()) <= TOLERANCE[key.rsplit("_", 1)[1]], (key, errors)
    print(json.dumps(results, indent=1))
