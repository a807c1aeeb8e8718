"""cann-recipes-infer's Qwen3-MoE and DeepSeek-R1 expert-parallel prefill, run unchanged on a
CPU (tests/test_cann_recipes_peers.py, ``-m peers``).

Their files are copied at test time into a temporary folder, never into this repository:
from a checkout named by ``$CANN_RECIPES_INFER``, else from the bare git mirror
``$CANN_RECIPES_INFER_GIT`` (default :data:`DEFAULT_MIRROR`). Copied and run as they are:
``models/qwen3_moe/models/modeling_qwen3_moe.py``, ``models/deepseek_r1/models/modeling_deepseek.py``,
``module/fuse_moe_gmm.py`` (FusedMoEGMM: the two grouped matmuls and SwiGLU) and
``module/utils.py`` (``split_moe_tensors``). Their other imports are not MoE code and are stubbed:
torchair, transformers, the recipes' ``executor`` package, ``module.linear`` (plain matmuls),
``module.quantization`` (the base class only), the configuration and ``.modules`` files (config
classes, RMSNorm, rope); ``Tensor.npu()`` returns the CPU tensor and ``torch.npu`` (streams,
events) is a stub. The MoE operators come
from ``moe_onnx.torch.install_stand_ins()``.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from types import ModuleType, SimpleNamespace

import numpy as np
import torch
import torch.distributed as dist

from tests.moe_chain import Config, dense_reference, global_weights, local_slice, rank_inputs, relative_error

DEFAULT_MIRROR = "/work/.mirror/hicann+cann-recipes-infer/repo"
FILES = {
    "models/qwen3_moe/models/modeling_qwen3_moe.py": "cann_recipes_qwen3/modeling_qwen3_moe.py",
    "models/deepseek_r1/models/modeling_deepseek.py": "cann_recipes_deepseek/modeling_deepseek.py",
    "module/fuse_moe_gmm.py": "module/fuse_moe_gmm.py",
    "module/utils.py": "module/utils.py",
}


class SourceMissing(RuntimeError):
    pass


def peer_sources(test: str, modules: tuple[str, ...], copy: Callable[[Path], object], dest: Path) -> Path:
    """``dest`` after ``copy(dest)`` put a peer's sources there, for the peers test ``test``; the
    test fails (never skips) naming what is missing: one of ``modules`` not importable, or the
    sources (:class:`SourceMissing`, which says how to provide them)."""
    import pytest

    for needed in modules:
        try:
            importlib.import_module(needed)
        except ImportError as err:
            pytest.fail(f"the {test} peers test needs {needed} installed: {err}")
    try:
        copy(dest)
    except SourceMissing as err:
        pytest.fail(f"the {test} peers test needs its sources: {err}")
    return dest


def copy_sources(
    dest: Path,
    files: dict[str, str] = FILES,
    *,
    checkout_env: str = "CANN_RECIPES_INFER",
    mirror_env: str = "CANN_RECIPES_INFER_GIT",
    default_mirror: str = DEFAULT_MIRROR,
    revision: str = "HEAD",
    repository: str = "hicann/cann-recipes-infer",
) -> str:
    """Copy ``files`` (source path -> path under ``dest``; default :data:`FILES`) into ``dest``
    (packages with empty ``__init__.py``): from the checkout ``$checkout_env`` if set, else at
    ``revision`` of the bare git mirror ``$mirror_env`` (default ``default_mirror``); returns
    where they came from. Raises :class:`SourceMissing` saying how to provide them."""
    checkout = os.environ.get(checkout_env)
    mirror = os.environ.get(mirror_env, default_mirror)
    for source, target in files.items():
        path = dest / target
        path.parent.mkdir(parents=True, exist_ok=True)
        (path.parent / "__init__.py").touch()
        if checkout:
            origin = Path(checkout) / source
            if not origin.is_file():
                raise SourceMissing(f"${checkout_env}={checkout} has no {source} (a {repository} checkout)")
            path.write_bytes(origin.read_bytes())
            continue
        result = subprocess.run(["git", "--git-dir", mirror, "show", f"{revision}:{source}"], capture_output=True)
        if result.returncode != 0:
            raise SourceMissing(
                f"cannot read {revision}:{source} from the git mirror {mirror} ({result.stderr.decode().strip()}): "
                f"set ${checkout_env} to a checkout of {repository}, or ${mirror_env} to a bare clone"
            )
        path.write_bytes(result.stdout)
    return checkout or f"{mirror} at {revision}"


def run_script(code: str, *args: str) -> dict:
    """Run ``code`` (which prints one JSON line last) in a fresh interpreter from the repository
    root, so that its stubs and stand-ins stay out of the test's process; returns that JSON.
    Raises AssertionError with the script's error output when it fails."""
    import json

    root = Path(__file__).resolve().parent.parent
    run = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300, cwd=root)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


# --- stubs of the non-MoE imports -----------------------------------------------------------


class Anything:
    """Whatever a stubbed name is used as: called, it returns a new one (or, as a decorator,
    the function); any attribute is another one."""

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]
        return Anything()

    def __getattr__(self, name):
        return Anything()


class Linear(torch.nn.Module):
    """module.linear's layers as a plain ``x @ weight.T`` (no tensor parallelism)."""

    def __init__(self, input_size=None, output_size=None, *args, output_sizes=None, **kwargs):
        super().__init__()
        out = sum(output_sizes) if output_sizes else output_size
        self.weight = torch.nn.Parameter(torch.zeros(out, input_size), requires_grad=False)

    def forward(self, x, *args, **kwargs):
        return x @ self.weight.T.to(x.dtype)


class QuantizeMethodBase:
    """module.quantization's base class (the unquantised FusedMoEGMM method derives from it)."""


def _module(name: str, **names) -> ModuleType:
    module = ModuleType(name, "stub: a non-MoE import of cann-recipes-infer (tests/cann_recipes.py)")
    module.__dict__.update(names)
    module.__path__ = []  # type: ignore[attr-defined]  # a package: its stubbed submodules import
    module.__getattr__ = lambda attr: Anything()  # type: ignore[attr-defined]
    return module


STUBS = (
    "torchair",
    "transformers",
    "transformers.utils",
    "transformers.configuration_utils",
    "transformers.modeling_rope_utils",
    "transformers.modeling_attn_mask_utils",
    "transformers.pytorch_utils",
    "executor",
    "executor.utils",
    "executor.utils.forward_metadata",
    "executor.utils.stream_utils",
    "executor.core",
    "executor.core.config",
    "executor.core.kv_cache",
    "executor.core.kv_cache.cache_info",
    "executor.model_loader",
    "executor.model_loader.weight_utils",
    "module.quantization.compressed_tensors",
    "module.quantization.compressed_tensors.compressed_tensors_moe_gmm",
    "cann_recipes_qwen3.configuration_qwen3_moe",
    "cann_recipes_deepseek.configuration_deepseek",
    "cann_recipes_deepseek.modules",
)


def install(source_dir: Path) -> None:
    """The stubs in sys.modules, the copied files importable, torch_npu's stand-in."""
    import moe_onnx.torch as mt

    mt.install_stand_ins()
    for name in STUBS:
        sys.modules[name] = _module(name)
    linear = {n: Linear for n in ("ReplicatedLinear", "ColumnParallelLinear", "QKVParallelLinear")}
    linear.update({n: Linear for n in ("RowParallelLinear", "MergedColumnParallelLinear", "VocabParallelEmbedding")})
    sys.modules["module.linear"] = _module("module.linear", **linear)
    sys.modules["module.quantization"] = _module("module.quantization", QuantizeMethodBase=QuantizeMethodBase)
    torch.Tensor.npu = lambda self, *args, **kwargs: self  # type: ignore[attr-defined]  # the device: CPU here
    if not hasattr(torch, "npu"):
        torch.npu = Anything()  # type: ignore[attr-defined]  # streams and events in annotations
    sys.path.insert(0, str(source_dir))


# --- the two blocks, built by their own constructors ------------------------------------------


class CommManager:
    """The recipes' CommManager: every group is the default gloo group."""

    def __init__(self, rank: int):
        self.rank = rank
        self.config = SimpleNamespace(global_rank=rank)

    def get_group(self, name):
        return dist.group.WORLD

    def has_group(self, name):
        return name == "moe_ep_group"

    def get_rank(self, name):
        return self.rank

    def get_group_name(self, name):
        return name


def infer_config(world: int):
    parallel = SimpleNamespace(moe_tp_size=1, moe_ep_size=world, attn_tp_size=1, dense_tp_size=1)
    model = SimpleNamespace(force_eplb=False, exe_mode="eager", custom_params={})
    return SimpleNamespace(
        parallel_config=parallel,
        model_config=model,
        scheduler_config=SimpleNamespace(batch_size=4),
        data_config=SimpleNamespace(input_truncated_len=64),
    )


def model_config(config: Config):
    return SimpleNamespace(
        hidden_size=config.hidden,
        moe_intermediate_size=config.ffn,
        num_experts=config.experts,
        n_routed_experts=config.experts,
        num_experts_per_tok=config.top_k,
        n_shared_experts=1,
        max_position_embeddings=64,
        norm_topk_prob=True,
        quant_config=None,
        routed_scaling_factor=1.0,
        scoring_func="sigmoid",
        topk_method="noaux_tc",
        n_group=1,
        topk_group=1,
    )


def load_experts(experts, config: Config, rank: int, weights: dict, dtype) -> None:
    """This rank's checkpoint slice into FusedMoEGMM, then its own process_weights_after_loading
    with its default is_nz=True (the weights cast to FRACTAL_NZ: a logical no-op on a CPU)."""
    local = local_slice(config, rank)
    experts.w13_weight.data = weights["w13"][local].to(dtype).clone()
    experts.w2_weight.data = weights["w2"][local].to(dtype).clone()
    experts.quant_method.process_weights_after_loading(experts, is_nz=True)


def qwen3_block(config: Config, rank: int, world: int, weights: dict, dtype):
    from cann_recipes_qwen3.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    block = Qwen3MoeSparseMoeBlock(model_config(config), infer_config(world), CommManager(rank), prefix="layers.0.mlp")
    load_experts(block.experts, config, rank, weights, dtype)
    return block


def deepseek_block(config: Config, rank: int, world: int, weights: dict, dtype):
    from cann_recipes_deepseek.modeling_deepseek import DeepseekV3MoE

    block = DeepseekV3MoE(model_config(config), infer_config(world), CommManager(rank), 0, prefix="layers.3.mlp")
    load_experts(block.experts, config, rank, weights, dtype)
    block.shared_experts.gate_up_proj.weight.data = weights["shared_gate_up"].to(dtype)
    block.shared_experts.down_proj.weight.data = weights["shared_down"].to(dtype)
    return block


def worker(rank: int, world: int, init_file: str, config: Config, source_dir: str, out_dir: str) -> None:
    """Both blocks' ``moe_infer_double_routing`` at every batch size, float32 and bfloat16."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world, timeout=timedelta(seconds=120)
    )
    install(Path(source_dir))
    weights = global_weights(config)
    errors = {}
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).split(".")[-1]
        qwen3 = qwen3_block(config, rank, world, weights, dtype)
        deepseek = deepseek_block(config, rank, world, weights, dtype)
        for tokens in config.batches:
            x, topk_ids, topk_weight = rank_inputs(config, rank, tokens + rank)
            x = x.to(dtype)
            y = qwen3.moe_infer_double_routing(x, topk_ids, topk_weight)
            want = dense_reference(x, topk_ids, topk_weight, weights, with_shared=False)
            errors[f"qwen3_{name}_{tokens}"] = relative_error(y, want)
            shared = deepseek.forward_shared_expert(x, is_prefill=True)  # npu_swiglu on the dense MLP
            y = deepseek.moe_infer_double_routing(x, topk_ids, topk_weight, shared)
            want = dense_reference(x, topk_ids, topk_weight, weights, with_shared=True)
            errors[f"deepseek_{name}_{tokens}"] = relative_error(y, want)
            errors[f"dtype_ok_{name}_{tokens}"] = float(y.dtype == dtype and y.shape == x.shape)
    np.savez(Path(out_dir) / f"errors{rank}.npz", **errors)
    traced = try_export(config, rank, world, weights)  # on every rank: it may reach the collectives
    (Path(out_dir) / f"export{rank}.txt").write_text(traced)
    dist.barrier()
    dist.destroy_process_group()


def try_export(config: Config, rank: int, world: int, weights: dict) -> str:
    """Does torch.export trace Qwen3MoeSparseMoeBlock.moe_infer_double_routing? The first
    error, or "traced"."""

    class Prefill(torch.nn.Module):
        def __init__(self, block):
            super().__init__()
            self.block = block

        def forward(self, x, topk_ids, topk_weight):
            return self.block.moe_infer_double_routing(x, topk_ids, topk_weight)

    import moe_onnx.torch as mt

    block = qwen3_block(config, rank, world, weights, torch.float32)
    example = rank_inputs(config, rank, config.batches[0] + rank)
    try:
        program = torch.export.export(Prefill(block), example, strict=False)
    except Exception as err:  # noqa: BLE001 - reported, not raised
        return f"torch.export: {type(err).__name__}: {str(err)[:1500]}"
    ops = sorted({str(n.target) for n in program.graph.nodes if n.op == "call_function"})
    report = "torch.export traced: " + ", ".join(o for o in ops if "cann_moe" in o or "c10d" in o or "all_to_all" in o)
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"recipes_qwen3_rank{rank}.onnx"
    tokens = torch.export.Dim("T")
    try:
        mt.export(Prefill(block), example, path, dynamic_shapes=({0: tokens}, {0: tokens}, {0: tokens}))
    except Exception as err:  # noqa: BLE001 - reported, not raised
        return report + f"\nmt.export (ONNX): {type(err).__name__}: {str(err)[:1500]}"
    return report + f"\nmt.export (ONNX, dynamic token count): written to {path}"
