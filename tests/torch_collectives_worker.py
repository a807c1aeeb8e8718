"""One gloo rank for test_torch_collectives: eager collectives, their gradients, a bad input,
and the export of torch.distributed's own collectives (functional and in-place)."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc
import torch.distributed.nn.functional as dist_nn

import moe_onnx
import moe_onnx.torch as mt
from moe_onnx.torch.arrays import to_numpy


def a2a_inputs(rank: int, world: int):
    """Rank r sends r + d + 1 rows to rank d (bfloat16, NaN payloads and -0.0 included)."""
    send_counts = torch.tensor([rank + d + 1 for d in range(world)], dtype=torch.int64)
    bits = torch.arange(int(send_counts.sum()) * 3, dtype=torch.int32).view(-1, 3) + 1000 * rank
    bits[0, 0], bits[0, 1] = 0x7FC3, 0x8000
    return bits.to(torch.int16).view(torch.bfloat16), send_counts


class InPlaceAllToAll(torch.autograd.Function):
    """fairscale / DeepSpeed style: an equal-split ``dist.all_to_all_single`` into a new tensor."""

    @staticmethod
    def forward(ctx, x):
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x.contiguous())
        return out

    @staticmethod
    def backward(ctx, grad):
        return InPlaceAllToAll.apply(grad)


class TorchCollectives(torch.nn.Module):
    """Megatron-style ragged exchange with torch's functional collectives, plus the in-place one."""

    def forward(self, x, counts):
        world = dist.get_world_size()
        gathered = fc.all_gather_tensor(counts, 0, dist.group.WORLD).view(world, world)  # [src, dst]
        send = counts.tolist()
        recv = gathered[:, dist.get_rank()].tolist()
        ragged = fc.all_to_all_single(x, recv, send, dist.group.WORLD)
        equal = InPlaceAllToAll.apply(x[: 2 * world] * 2)
        return ragged + 0, equal, gathered


def worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    torch.set_num_threads(1)  # the ranks share the machine's cores
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )  # a hung rank fails the test instead of stalling the suite for gloo's 30 minutes
    out = Path(out_dir)
    saved = {}

    data, send_counts = a2a_inputs(rank, world)
    recv, recv_counts = mt.all_to_all(data, send_counts)
    gathered = mt.all_gather(torch.arange(6, dtype=torch.int32).view(2, 3) * (rank + 1))
    saved.update(
        a2a_recv_bits=to_numpy(recv).view(np.uint16), a2a_recv_counts=recv_counts.numpy(), gathered=gathered.numpy()
    )

    # gradients against torch.distributed's differentiable collectives
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(rank))
    ours, ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    weight = torch.randn(world, 4, 3, generator=torch.Generator().manual_seed(10 + rank))
    (mt.all_gather(ours) * weight).sum().backward()
    (torch.stack(dist_nn.all_gather(ref)) * weight).sum().backward()
    saved["all_gather_grad_error"] = float((ours.grad - ref.grad).abs().max())
    rows = data.float().requires_grad_()
    ref_rows = data.float().requires_grad_()
    received, _ = mt.all_to_all(rows, send_counts)
    ref_received = dist_nn.all_to_all_single(
        torch.empty(int(recv_counts.sum()), 3), ref_rows, recv_counts.tolist(), send_counts.tolist()
    )
    cotangent = torch.randn(received.shape, generator=torch.Generator().manual_seed(20 + rank))
    (received.nan_to_num() * cotangent).sum().backward()
    (ref_received.nan_to_num() * cotangent).sum().backward()
    saved["all_to_all_grad_equal"] = bool(torch.equal(rows.grad, ref_rows.grad))

    # a bad input on rank 1 only: every rank raises the same MoeOpError
    bad_counts = send_counts + (1 if rank == 1 else 0)
    try:
        mt.all_to_all(data, bad_counts)
        saved["bad_input_error"] = "no error"
    except moe_onnx.MoeOpError as err:
        saved["bad_input_error"] = str(err)

    # torch.distributed's collectives, eager and exported with a dynamic row count
    module = TorchCollectives()
    x = torch.randn(12, 3, generator=torch.Generator().manual_seed(30 + rank))
    counts = torch.tensor([3 + rank, 9 - rank] if world == 2 else [12 // world] * world, dtype=torch.int64)
    for name, value in zip(("ragged", "equal", "gathered"), module(x, counts)):
        saved[f"torch_{name}"] = value.numpy()
    saved["torch_x"], saved["torch_counts"] = x.numpy(), counts.numpy()
    mt.export(module, (x, counts), out / f"torch{rank}.onnx", dynamic_shapes=({0: torch.export.Dim("S")}, None))
    np.savez(out / f"rank{rank}.npz", **saved)
    dist.barrier()
    dist.destroy_process_group()
