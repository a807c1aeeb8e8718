"""One gloo rank for test_torch_peers: fairscale's or DeepSpeed's MOELayer, as its package
ships it (its own ``_AllToAll`` autograd Function over ``dist.all_to_all_single``), run eagerly
and exported with plain ``torch.onnx.export(dynamo=True)`` + moe_onnx's translation table.

Only fairscale's Gumbel noise on the second expert is zeroed (``top2gate.gumbel_rsample``), so
that eager and ONNX outputs can be compared; DeepSpeed's is off by configuration
(``top2_2nd_expert_sampling=False``). Sizes: 16 tokens of width 16, 2 local experts per rank.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

import moe_onnx.torch

MODEL, FFN, TOKENS, LOCAL_EXPERTS = 16, 32, 16, 2


class Expert(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(MODEL, FFN, bias=False)
        self.fc2 = torch.nn.Linear(FFN, MODEL, bias=False)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class DeepSpeedCall(torch.nn.Module):
    """DeepSpeed's MOELayer.forward takes (input, used_token)."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        return self.layer(x, None)


def _seed(gate, experts, rank):
    with torch.no_grad():
        gate.wg.weight.copy_(torch.randn(gate.wg.weight.shape, generator=torch.Generator().manual_seed(1000)))
        for i, expert in enumerate(experts):
            g = torch.Generator().manual_seed(2000 + rank * LOCAL_EXPERTS + i)
            for _, p in sorted(expert.named_parameters()):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def fairscale_layer(rank: int, world: int) -> torch.nn.Module:
    from fairscale.nn.moe import MOELayer, Top2Gate, top2gate

    top2gate.gumbel_rsample = lambda shape, device: torch.zeros(shape, device=device)
    gate = Top2Gate(MODEL, LOCAL_EXPERTS * world)
    experts = torch.nn.ModuleList([Expert() for _ in range(LOCAL_EXPERTS)])
    _seed(gate, experts, rank)
    return MOELayer(gate, experts).eval()


def deepspeed_layer(rank: int, world: int) -> torch.nn.Module:
    import deepspeed.comm
    from deepspeed.moe.experts import Experts
    from deepspeed.moe.sharded_moe import MOELayer, TopKGate

    deepspeed.comm.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    gate = TopKGate(
        MODEL,
        LOCAL_EXPERTS * world,
        k=2,
        capacity_factor=1.0,
        eval_capacity_factor=1.0,
        min_capacity=1,
        drop_tokens=True,
        top2_2nd_expert_sampling=False,
    )
    experts = Experts(Expert(), LOCAL_EXPERTS, expert_group_name=f"ep_size_{world}")
    layer = MOELayer(gate, experts, f"ep_size_{world}", world, LOCAL_EXPERTS)
    layer._set_ep_group(dist.group.WORLD)
    _seed(gate, experts.deepspeed_experts, rank)
    return DeepSpeedCall(layer).eval()


LAYERS = {"fairscale": fairscale_layer, "deepspeed": deepspeed_layer}


def worker(rank: int, world: int, init_file: str, peer: str, out_dir: str) -> None:
    torch.set_num_threads(1)  # the ranks share the machine's cores
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )  # a hung rank fails the test instead of stalling the suite for gloo's 30 minutes
    module = LAYERS[peer](rank, world)
    inputs = [torch.randn(TOKENS, 1, MODEL, generator=torch.Generator().manual_seed(s + rank)) for s in (100, 200)]
    with torch.no_grad():
        outputs = [module(x) for x in inputs]
        torch.onnx.export(
            module,
            (inputs[0],),
            Path(out_dir) / f"rank{rank}.onnx",
            dynamo=True,
            custom_translation_table=moe_onnx.torch.translation_table(),
            input_names=["x"],
            output_names=["y"],
        )
    np.savez(
        Path(out_dir) / f"eager{rank}.npz",
        x0=inputs[0].numpy(),
        x1=inputs[1].numpy(),
        y0=outputs[0].numpy(),
        y1=outputs[1].numpy(),
    )
    dist.barrier()
    dist.destroy_process_group()
