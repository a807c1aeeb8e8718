"""Issue 30's EP export: a Megatron-style expert-parallel layer written with moe_onnx.torch's
permute ops, ``moe_token_permute(x, ids, num_out_tokens=T*K)`` and
``moe_token_unpermute(..., restore_shape=[T, H])`` (the symbolic spellings of "every slot"),
exported by ``moe_onnx.torch.export`` inside each gloo rank with a dynamic token count
(tests/test_ep_permute_export.py runs the models at two other token counts).

The layer is tests/torch_ep_layer.py's (router, weights, local experts, AllGather of the
counts, AllToAll, MoeReRoutingV2 to group the received rows by local expert) with the
dispatch and combine taken by the permute pair, so its eager outputs are checked against that
file's pure-torch Megatron ``ReferenceLayer``.

:func:`worker` runs one rank: eager outputs of both layers at every token count, the export of
:class:`PermuteLayer` at the first, and the export of :class:`SpecialisingLayer` (the same layer
with ``num_out_tokens=int(T) * K``, a Python int that fixes T), whose error is saved.
"""

from __future__ import annotations

import traceback
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from tests.torch_ep_layer import Config, MoeOnnxLayer, ReferenceLayer, rank_tokens, relative_error


class PermuteLayer(MoeOnnxLayer):
    """``forward(x [T, H]) -> [T, H]`` on one rank of ``config.ranks``."""

    def slots(self, x) -> int:
        """num_out_tokens: every slot, T*K (symbolic while exporting)."""
        return x.shape[0] * self.config.top_k

    def forward(self, x):
        import moe_onnx.torch as mt

        probs, routing_map, top_experts = self.route(x)
        top_probs = probs.gather(1, top_experts)  # [T, K], the order of top_experts
        # rows[d] for d in expert-major order (each expert's rows in token order)
        rows, sorted_indices = mt.moe_token_permute(x, top_experts.to(torch.int32), num_out_tokens=self.slots(x))
        returned = self.exchange(rows, routing_map.sum(0))  # [E] rows for each expert
        return mt.moe_token_unpermute(returned, sorted_indices, top_probs, restore_shape=[x.shape[0], x.shape[1]])


class SpecialisingLayer(PermuteLayer):
    """The same layer with ``num_out_tokens`` made a Python int: torch specialises T to the
    example's token count at that line, so the export must refuse."""

    def slots(self, x) -> int:
        return int(x.shape[0]) * self.config.top_k


def worker(rank: int, world: int, init_file: str, config: Config, out_dir: str) -> None:
    """Eager outputs (and their error vs the reference) at every token count, then the two
    exports: ``rank{r}.onnx`` and ``specialising{r}.txt`` (the export's error, or "exported")."""
    import moe_onnx.torch as mt

    torch.set_num_threads(1)  # the ranks share the machine's cores
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )
    out = Path(out_dir)
    layer, reference = PermuteLayer(config, rank).eval(), ReferenceLayer(config, rank).eval()
    errors = {}
    for tokens in config.batches:
        x = rank_tokens(config, rank, tokens + rank)  # the ranks' token counts differ
        with torch.no_grad():
            y, want = layer(x), reference(x)
        errors[f"T{tokens}"] = relative_error(y, want)
        np.savez(out / f"in{rank}_T{tokens}.npz", x=x.numpy())
        np.save(out / f"eager{rank}_T{tokens}.npy", y.numpy())
    np.savez(out / f"errors{rank}.npz", **errors)
    example = (rank_tokens(config, rank, config.batches[0] + rank),)
    dynamic = ({0: torch.export.Dim("T")},)
    with torch.no_grad():
        mt.export(layer, example, out / f"rank{rank}.onnx", dynamic_shapes=dynamic)
        try:
            static = SpecialisingLayer(config, rank).eval()
            mt.export(static, example, out / f"static{rank}.onnx", dynamic_shapes=dynamic)
            result = "exported"
        except Exception as err:  # noqa: BLE001 - the error is what the test checks
            result = f"{type(err).__name__}: {err}\n{traceback.format_exc()[-2000:]}"
    (out / f"specialising{rank}.txt").write_text(result)
    dist.barrier()
    dist.destroy_process_group()
