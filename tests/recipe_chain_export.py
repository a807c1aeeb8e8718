"""cann-recipes-infer's expert-parallel prefill call pattern (tests/moe_chain.py
``ascend_double_routing``: torch_npu's names, ``active_num = T*K``, ``dist.all_to_all_single``
with host-side splits) exported by ``moe_onnx.torch.export`` on each gloo rank with a dynamic
token count (tests/test_recipe_chain_export.py runs the models).

:func:`worker` runs one rank: the eager outputs at every token count of the config, and
``rank{r}.onnx`` exported at the first. The collectives are traced as torch's functional
collectives (the splits computed in the graph), so the export runs inside the process group.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from tests.moe_chain import Config, ascend_double_routing, fused_moe_weights, global_weights, rank_inputs, shared_expert

INPUTS = ("x", "topk_ids", "topk_weight", "shared")


class RecipeChain(torch.nn.Module):
    """``forward(x, topk_ids, topk_weight, shared) -> y``: one rank of ascend_double_routing,
    the weights as FusedMoEGMM holds them (transposed views)."""

    def __init__(self, config: Config, rank: int, weights: dict, world: int):
        super().__init__()
        self.experts, self.world = config.experts, world
        w13, w2 = fused_moe_weights(config, rank, weights, torch.float32)
        self.register_buffer("w13", w13)
        self.register_buffer("w2", w2)

    def forward(self, x, topk_ids, topk_weight, shared):
        return ascend_double_routing(x, topk_ids, topk_weight, self.w13, self.w2, self.experts, self.world, shared)


def worker(rank: int, world: int, init_file: str, config: Config, out_dir: str) -> None:
    import moe_onnx.torch as mt

    torch.set_num_threads(1)  # the ranks share the machine's cores
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )
    mt.install_stand_ins()
    out = Path(out_dir)
    weights = global_weights(config)
    chain = RecipeChain(config, rank, weights, world).eval()
    examples = {}
    for tokens in config.batches:
        x, topk_ids, topk_weight = rank_inputs(config, rank, tokens + rank)
        examples[tokens] = (x, topk_ids, topk_weight, shared_expert(x, weights))
        with torch.no_grad():
            y = chain(*examples[tokens])
        np.savez(out / f"in{rank}_T{tokens}.npz", **{name: t.numpy() for name, t in zip(INPUTS, examples[tokens])})
        np.save(out / f"eager{rank}_T{tokens}.npy", y.numpy())
    tokens = torch.export.Dim("T")
    with torch.no_grad():
        mt.export(
            chain,
            examples[config.batches[0]],
            out / f"rank{rank}.onnx",
            dynamic_shapes=({0: tokens}, {0: tokens}, {0: tokens}, {0: tokens}),
        )
    dist.barrier()
    dist.destroy_process_group()
