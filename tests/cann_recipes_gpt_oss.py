"""cann-recipes-infer's gpt-oss MoE MLP (``GptOssMLP`` of
``models/gpt_oss/models/modeling_gpt_oss.py``) run unchanged on a CPU
(tests/test_cann_recipes_gpt_oss_peers.py, ``-m peers``).

The file is copied at test time into a temporary folder (tests/cann_recipes.py
``copy_sources``: a checkout ``$CANN_RECIPES_INFER`` or the bare mirror), never into this
repository. Its non-MoE imports are stubbed as for the Qwen3 / DeepSeek blocks
(tests/cann_recipes.py ``install``), plus its ``.configuration_gpt_oss``; the router, a
``ColumnParallelLinear`` with bias, is a plain ``x @ W.T + b``. The MoE operators come from
``moe_onnx.torch.install_stand_ins()``.

:func:`worker` builds the MLP as the recipe's loader does (under
``torch.set_default_dtype``, the biases float32) on ``moe_tp_size`` = world ranks, loads this
rank's slice of the checkpoint the way ``GptOssForCausalLM.load_weights`` slices it, and
compares ``GptOssMLP.forward`` with the dense reference of tests/gpt_oss_mlp.py. On one rank it
also exports the MLP with a dynamic token count and runs the model at every token count.
"""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist

from tests.gpt_oss_mlp import MlpConfig, dense_reference, mlp_weights, relative_error, router_logits, tokens

MODULE = "cann_recipes_gpt_oss"
FILES = {"models/gpt_oss/models/modeling_gpt_oss.py": f"{MODULE}/modeling_gpt_oss.py"}


class BiasedLinear(torch.nn.Module):
    """module.linear's ColumnParallelLinear (the router: tp_size=1, bias=True) as ``x @ W.T + b``."""

    def __init__(self, input_size=None, output_size=None, bias=False, *args, **kwargs):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(output_size, input_size), requires_grad=False)
        self.bias = torch.nn.Parameter(torch.zeros(output_size), requires_grad=False) if bias else None

    def forward(self, x):
        return router_logits(x, self.weight, self.bias)


def install(source_dir: Path) -> None:
    from tests import cann_recipes

    cann_recipes.install(source_dir)
    name = f"{MODULE}.configuration_gpt_oss"
    sys.modules[name] = cann_recipes._module(name)
    sys.modules["module.linear"].ColumnParallelLinear = BiasedLinear  # type: ignore[attr-defined]


def gpt_oss_mlp(config: MlpConfig, rank: int, world: int, weights: dict, dtype):
    """The recipe's GptOssMLP with moe_tp_size = world, this rank's slice loaded by copy_ as
    GptOssForCausalLM.load_weights does (gate_up columns 2*start:2*end, down rows start:end,
    down_proj_bias only on rank 0: the all-reduce adds it once)."""
    from cann_recipes_gpt_oss.modeling_gpt_oss import GptOssMLP

    from tests.cann_recipes import CommManager

    model_config = SimpleNamespace(
        num_local_experts=config.experts,
        hidden_size=config.hidden,
        num_experts_per_tok=config.top_k,
        intermediate_size=config.ffn,
    )
    infer_config = SimpleNamespace(parallel_config=SimpleNamespace(moe_tp_size=world))
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # executor/model_loader/default_loader.py: set_default_torch_dtype
    try:
        mlp = GptOssMLP(model_config, infer_config, CommManager(rank), prefix="model.layers.0.mlp")
    finally:
        torch.set_default_dtype(default)
    per_rank = config.ffn // world
    start, end = rank * per_rank, (rank + 1) * per_rank
    sliced = {
        "router.weight": weights["router.weight"],
        "router.bias": weights["router.bias"],
        "experts.gate_up_proj": weights["experts.gate_up_proj"][:, :, 2 * start : 2 * end],
        "experts.gate_up_proj_bias": weights["experts.gate_up_proj_bias"][:, 2 * start : 2 * end],
        "experts.down_proj": weights["experts.down_proj"][:, start:end, :],
        "experts.down_proj_bias": weights["experts.down_proj_bias"] * (rank == 0),
    }
    parameters = dict(mlp.named_parameters())
    assert sorted(parameters) == sorted(sliced), sorted(parameters)
    for name, tensor in sliced.items():
        parameters[name].data.copy_(tensor.contiguous())
    return mlp


def held(weights: dict, mlp) -> dict:
    """The whole checkpoint in the dtypes the model holds it (what the reference reads)."""
    dtypes = {name: p.dtype for name, p in mlp.named_parameters()}
    return {name: tensor.to(dtypes[name]) for name, tensor in weights.items()}


def worker(rank: int, world: int, init_file: str, config: MlpConfig, source_dir: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )
    install(Path(source_dir))
    weights = mlp_weights(config)
    results: dict[str, float] = {}
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).split(".")[-1]
        mlp = gpt_oss_mlp(config, rank, world, weights, dtype)
        full = held(weights, mlp)
        results[f"bias_float32_{name}"] = float(mlp.experts.gate_up_proj_bias.dtype == torch.float32)
        for count in config.batches:
            x = tokens(config, count).to(dtype)
            y = mlp(x)
            logits = router_logits(x, full["router.weight"], full["router.bias"])
            results[f"error_{name}_{count}"] = relative_error(y, dense_reference(x, logits, full, config.top_k))
            results[f"dtype_ok_{name}_{count}"] = float(y.dtype == dtype and y.shape == x.shape)
    if world == 1:
        results.update(export_and_run(config, weights, Path(out_dir)))
    np.savez(Path(out_dir) / f"results{rank}.npz", **results)
    dist.barrier()
    dist.destroy_process_group()


def export_and_run(config: MlpConfig, weights: dict, out_dir: Path) -> dict[str, float]:
    """GptOssMLP itself through ``moe_onnx.torch.export`` with a dynamic token count, then
    moe_onnx.InferenceSession at every token count: the largest relative difference to eager."""
    import onnx

    import moe_onnx
    import moe_onnx.torch as mt

    mlp = gpt_oss_mlp(config, 0, 1, weights, torch.float32).eval()
    path = out_dir / "gpt_oss_mlp.onnx"
    with torch.no_grad():
        mt.export(mlp, (tokens(config, config.batches[0]),), path, dynamic_shapes=({0: torch.export.Dim("T")},))
    model = onnx.load(path)
    found = {"dynamic": float(bool(model.graph.input[0].type.tensor_type.shape.dim[0].dim_param))}
    (path.parent / "gpt_oss_ops.txt").write_text(
        " ".join(n.op_type for n in model.graph.node if n.domain == moe_onnx.DOMAIN)
    )
    session = moe_onnx.InferenceSession(str(path))
    for count in config.batches:
        x = tokens(config, count, seed=3)
        with torch.no_grad():
            want = mlp(x)
        (got,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
        found[f"export_{count}"] = relative_error(torch.from_numpy(got), want)
    return found
