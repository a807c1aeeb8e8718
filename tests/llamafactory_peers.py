"""LLaMA-Factory's NPU fused MoE kernel run unchanged on CPU (tests/test_llamafactory_peers.py,
``-m peers``).

Its file is copied at test time into a temporary folder, never into this repository: from a
checkout named by ``$LLAMA_FACTORY``, else from the bare git mirror ``$LLAMA_FACTORY_GIT``
(default :data:`DEFAULT_MIRROR`) at ``HEAD``: ``src/llamafactory/v1/plugins/model_plugins/
kernels/ops/mlp/npu_fused_moe.py`` (``NpuFusedMoEKernel._apply`` patches a model's MoE modules
with ``NpuMoeFusedV5.experts_forward``: ``npu_moe_token_permute``, ``GmmFunction``
(``npu_grouped_matmul`` with counts; backward with ``group_type=2``), ``npu_swiglu``,
``npu_moe_token_unpermute``; and ``NpuMoeFusedV4.sparse_block_forward``: the list form of
``npu_grouped_matmul`` (``group_type=-1``) in ``HybridGmmFunction``).

Its relative imports are LLaMA-Factory's plugin registry, logging and accelerator helpers, not
MoE code, and are stubbed (:func:`install`); the transformers version it asks is the installed
one's.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import torch

from tests.cann_recipes import Anything, _module, copy_sources

DEFAULT_MIRROR = "/work/.mirror/hiyouga+LLaMA-Factory/repo"
SOURCE = "src/llamafactory/v1/plugins/model_plugins/kernels/ops/mlp/npu_fused_moe.py"
MODULE = "llamafactory.v1.plugins.model_plugins.kernels.ops.mlp.npu_fused_moe"


def copy_llamafactory(dest: Path) -> str:
    return copy_sources(
        dest,
        {SOURCE: SOURCE.removeprefix("src/")},
        checkout_env="LLAMA_FACTORY",
        mirror_env="LLAMA_FACTORY_GIT",
        default_mirror=DEFAULT_MIRROR,
        repository="hiyouga/LLaMA-Factory",
    )


def _newer_transformers(version: str) -> bool:
    """LLaMA-Factory's ``is_transformers_version_greater_than``: installed >= version."""
    import transformers
    from packaging.version import Version

    return Version(transformers.__version__) >= Version(version)


def install(source_dir: Path):
    """The stubs in ``sys.modules``, the file imported (returned), torch_npu's stand-in."""
    import importlib

    import moe_onnx.torch as mt

    mt.install_stand_ins()
    logger = SimpleNamespace(info_rank0=lambda *args, **kwargs: None, warning_rank0=lambda *args, **kwargs: None)
    modules = {
        "llamafactory.v1.accelerator": {},
        "llamafactory.v1.accelerator.helper": {"DeviceType": Anything(), "get_current_accelerator": Anything()},
        "llamafactory.v1.utils": {},
        "llamafactory.v1.utils.logging": {"get_logger": lambda name: logger},
        "llamafactory.v1.utils.packages": {"is_transformers_version_greater_than": _newer_transformers},
        "llamafactory.v1.utils.types": {},
        "llamafactory.v1.plugins.model_plugins.kernels.base": {
            "BaseKernel": type("BaseKernel", (), {}),
            "KernelPlugin": lambda name: SimpleNamespace(register=lambda: lambda cls: cls),
        },
    }
    for name, names in modules.items():
        sys.modules[name] = _module(name, **names)
    sys.path.insert(0, str(source_dir))
    return importlib.import_module(MODULE)


class V4SparseBlock(torch.nn.Module):
    """A Transformers v4 list-backed Qwen3-MoE sparse block's attributes, as
    ``NpuMoeFusedV4.sparse_block_forward`` reads them: ``gate`` (Linear H -> E), ``experts``
    (each ``gate_proj``, ``up_proj``: H -> I, ``down_proj``: I -> H), ``top_k``,
    ``num_experts``, ``norm_topk_prob``."""

    def __init__(self, hidden: int, inter: int, experts: int, top_k: int, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.top_k, self.num_experts, self.norm_topk_prob = top_k, experts, True
        self.gate = torch.nn.Linear(hidden, experts, bias=False)
        self.experts = torch.nn.ModuleList()
        for _ in range(experts):
            mlp = torch.nn.Module()
            mlp.gate_proj = torch.nn.Linear(hidden, inter, bias=False)
            mlp.up_proj = torch.nn.Linear(hidden, inter, bias=False)
            mlp.down_proj = torch.nn.Linear(inter, hidden, bias=False)
            self.experts.append(mlp)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)

    def dense(self, x: torch.Tensor) -> torch.Tensor:
        """The reference: softmax top-k renormalised, every expert on every token, in float32."""
        flat = x.reshape(-1, x.shape[-1]).float()
        probs = torch.softmax(flat @ self.gate.weight.float().T, -1)
        top, ids = probs.topk(self.top_k, dim=-1)
        weights = torch.zeros_like(probs).scatter(1, ids, top / top.sum(-1, keepdim=True))
        out = torch.zeros_like(flat)
        for e, mlp in enumerate(self.experts):
            h = torch.nn.functional.silu(flat @ mlp.gate_proj.weight.float().T) * (flat @ mlp.up_proj.weight.float().T)
            out = out + weights[:, e : e + 1] * (h @ mlp.down_proj.weight.float().T)
        return out.view(x.shape)
