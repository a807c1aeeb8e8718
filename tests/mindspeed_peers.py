"""MindSpeed's fused permute and grouped-matmul path run unchanged on CPU
(tests/test_mindspeed_peers.py, ``-m peers``).

Its files are copied at test time into a temporary folder, never into this repository: from a
checkout named by ``$MINDSPEED``, else from the bare git mirror ``$MINDSPEED_GIT`` (default
:data:`DEFAULT_MIRROR`) at ``HEAD``. Copied and run as they are (:data:`FILES`):

* ``mindspeed/te/pytorch/permutation.py``: ``MoePermuteMaskMap`` / ``MoeUnpermuteMaskMap``
  (``npu_moe_token_permute_with_routing_map``, ``_npu_moe_token_unpermute_with_routing_map``
  and their grads), what ``mindspeed/core/fusions/fused_moe_permute.py`` calls with
  ``moe_permute_fusion``;
* ``mindspeed/core/transformer/moe/grouped_matmul_util.py``: ``BF16GMMFunction.gmm_apply``
  (``npu_grouped_matmul`` with cumulative group lists, ``split_item=3``; the weight's gradient
  with ``group_type=2``), the grouped MLP's product.

Their other imports are MindSpeed's configuration and its other kernels, stubbed: the
arguments (no fp8, no gradient-accumulation fusion), ``WeightGradStore`` (not decoupled), and
the NPU version, reported as A5 so that ``BF16GMMFunction`` calls ``torch_npu.npu_grouped_matmul``
(below A5 it loads MindSpeed's own compiled ``npu_gmm``, not a torch_npu name). ``einops``
(``rearrange`` in the backward) must be installed.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import torch

from tests.cann_recipes import _module, copy_sources

DEFAULT_MIRROR = "/work/.mirror/Ascend+MindSpeed/repo"
FILES = {
    path: path
    for path in ("mindspeed/te/pytorch/permutation.py", "mindspeed/core/transformer/moe/grouped_matmul_util.py")
}


def copy_mindspeed(dest: Path) -> str:
    return copy_sources(
        dest,
        FILES,
        checkout_env="MINDSPEED",
        mirror_env="MINDSPEED_GIT",
        default_mirror=DEFAULT_MIRROR,
        repository="Ascend/MindSpeed",
    )


class _NpuVersion:
    """mindspeed.ops.npu_matmul_add's NPUVersion and check_npu_version, on an A5."""

    A2, A3, A5 = 2, 3, 5

    @staticmethod
    def check(min_version=None, max_version=None) -> bool:
        return (min_version is None or 5 >= min_version) and (max_version is None or 5 <= max_version)


def install(source_dir: Path) -> None:
    """The stubs in ``sys.modules``, the copied files importable, torch_npu's stand-in."""
    import moe_onnx.torch as mt

    mt.install_stand_ins()
    arguments = SimpleNamespace(
        fp8=False, use_gmm_fp8=False, gemm_gradient_accumulation_fusion=False, overlap_grad_reduce=False
    )
    store = SimpleNamespace(is_decoupleBlock=False)
    modules = {
        "mindspeed.args_utils": {"get_full_args": lambda: arguments},
        "mindspeed.core.transformer.moe.moe_feature": {},
        "mindspeed.core.transformer.moe.moe_feature.fb_overlap": {},
        "mindspeed.core.transformer.moe.moe_feature.fb_overlap.modules": {},
        "mindspeed.core.transformer.moe.moe_feature.fb_overlap.modules.weight_grad_store": {"WeightGradStore": store},
        "mindspeed.ops": {},
        "mindspeed.ops.npu_groupmatmul_add": {},
        "mindspeed.ops.npu_matmul_add": {"NPUVersion": _NpuVersion, "check_npu_version": _NpuVersion.check},
        "mindspeed.te.pytorch.fp8": {},
        "mindspeed.te.pytorch.fp8.constants": {},
        "mindspeed.te.pytorch.fp8.reuse": {},
        "mindspeed.te.pytorch.utils": {},
    }
    for name, names in modules.items():
        sys.modules[name] = _module(name, **names)
    torch.Tensor.npu = lambda self, *args, **kwargs: self  # type: ignore[attr-defined]
    sys.path.insert(0, str(source_dir))


def grouped_mlp(x, routing_map, probs, w1, w2, probs_in_experts: bool):
    """A MoE layer on MindSpeed's fused path, as Megatron's alltoall dispatcher and GroupedMLP
    call it on one rank: permute by the routing map (``num_out_tokens`` = every routed slot),
    fc1 and fc2 through ``BF16GMMFunction.gmm_apply`` with the tokens per expert, SwiGLU, the
    routing probabilities applied in the experts (``permuted_probs``, Megatron's
    ``moe_apply_probs_on_input``-free GroupedMLP) or by the unpermute; unpermute by the map.
    x [T, H], routing_map [T, E] bool, probs [T, E], w1 [E, H, 2F], w2 [E, F, H] -> [T, H]."""
    from mindspeed.core.transformer.moe.grouped_matmul_util import BF16GMMFunction
    from mindspeed.te.pytorch.permutation import MoePermuteMaskMap, MoeUnpermuteMaskMap

    num_out_tokens = int(routing_map.sum())
    permuted, permuted_probs, sorted_indices = MoePermuteMaskMap.apply(x, routing_map, probs, num_out_tokens, False)
    tokens_per_expert = routing_map.sum(0)
    fc1 = BF16GMMFunction.gmm_apply(permuted, w1, None, tokens_per_expert, w1)
    gate, up = fc1.chunk(2, dim=-1)
    hidden = torch.nn.functional.silu(gate) * up
    if probs_in_experts:
        hidden = hidden * permuted_probs.unsqueeze(-1).to(hidden.dtype)
    fc2 = BF16GMMFunction.gmm_apply(hidden, w2, None, tokens_per_expert, w2)
    unpermute_probs = None if probs_in_experts else probs
    return MoeUnpermuteMaskMap.apply(fc2, sorted_indices, x.shape, unpermute_probs, routing_map, False)
