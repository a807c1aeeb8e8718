"""One gloo rank for test_torch_legacy: a ragged exchange written with ``mt.all_gather`` /
``mt.all_to_all``, run eagerly on two batches and exported with the legacy TorchScript
exporter (the trace runs the collectives, so every rank exports at once) with the rows dynamic."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

import moe_onnx.torch as mt


class Exchange(torch.nn.Module):
    """Rows ``x [S, 3]`` sent ``send_counts [N]`` to each rank, doubled; every rank's counts."""

    def forward(self, x, send_counts):
        gathered = mt.all_gather(send_counts)  # [N, N]: [src, dst]
        received, recv_counts = mt.all_to_all(x * 2, send_counts)
        return received, recv_counts, gathered


def batch(rank: int, world: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank r sends ``seed % 3 + r + d`` rows to rank d."""
    send_counts = torch.tensor([seed % 3 + rank + d for d in range(world)], dtype=torch.int64)
    g = torch.Generator().manual_seed(seed * 10 + rank)
    return torch.randn(int(send_counts.sum()), 3, generator=g), send_counts


def worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)  # the ranks share the machine's cores
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )  # a hung rank fails the test instead of stalling the suite for gloo's 30 minutes
    mt.register_legacy_symbolics()
    module, saved = Exchange(), {}
    for name, seed in (("traced", 1), ("other", 5)):
        x, send_counts = batch(rank, world, seed)
        received, recv_counts, gathered = module(x, send_counts)
        saved.update(
            {f"{name}_x": x, f"{name}_send_counts": send_counts, f"{name}_received": received}
            | {f"{name}_recv_counts": recv_counts, f"{name}_gathered": gathered}
        )
    torch.onnx.export(
        module,
        (saved["traced_x"], saved["traced_send_counts"]),
        Path(out_dir) / f"rank{rank}.onnx",
        dynamo=False,
        input_names=["x", "send_counts"],
        output_names=["received", "recv_counts", "gathered"],
        dynamic_axes={"x": {0: "S"}},  # the received rows are left unknown by the symbolic itself
        opset_version=17,
    )
    np.savez(Path(out_dir) / f"rank{rank}.npz", **{k: v.numpy() for k, v in saved.items()})
    dist.barrier()
    dist.destroy_process_group()
