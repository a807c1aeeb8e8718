"""torch_npu's names of the dispatch operators (SPEC 1.11, 1.12, 1.15, 1.16): the token permute /
unpermute by expert indices with their grad entry points, v1 init routing and the expert-token
ends.

Index directions, as op-plugin defines them: ``npu_moe_token_permute``'s ``sorted_indices`` is
src slot -> dst row, the inverse of Megatron-LM's ``sorted_indices`` (op-plugin's test compares
it with ``argsort`` of Megatron's); ``npu_moe_token_unpermute`` gathers with that same index.
``npu_moe_init_routing``'s ``expanded_row_idx`` is src -> dst over the column-major numbering
``q = j*T + t`` of its ``row_idx``; ``npu_moe_compute_expert_tokens`` returns the inclusive
cumsum (exclusive end row of each expert), for GroupedMatmul's ``group_list_type 0``.
"""

from __future__ import annotations

import torch

from ...custom_ops import MoeOpError
from ...custom_ops.moe_init_routing_v2 import INT32_MAX
from ..ops import FUNCTIONS
from .common import follows as _follows
from .common import refuse as _refuse


def npu_moe_token_permute(tokens, indices, num_out_tokens=None, padded_mode=False):
    """torch_npu.npu_moe_token_permute(Tensor tokens, Tensor indices, int? num_out_tokens=None,
    bool padded_mode=False) -> (permuted_tokens, sorted_indices)

    Source: Ascend/op-plugin, op_plugin/config/op_plugin_functions.yaml (npu_moe_token_permute:
    ``num_out_tokens.value_or(0)``, then min(n, T*K) for n > 0 and T*K + n otherwise) and
    test/test_custom_ops/test_npu_moe_token_permute_and_unpermute.py. Runs
    ``cann.moe::MoeTokenPermute``; differentiable in tokens (derivatives.yaml: through
    npu_moe_token_permute_grad_v2). ``sorted_indices`` (int32, all T*K entries) maps src slot
    t*K + j -> dst row. ``padded_mode=True`` is refused, as on the NPU.
    """
    return FUNCTIONS["MoeTokenPermute"](
        tokens, indices, num_out_tokens=0 if num_out_tokens is None else num_out_tokens, padded_mode=int(padded_mode)
    )


def _token_count(name: str, op_type: str, sorted_indices, top_k: int, tokens_num: int) -> None:
    """torch_npu sizes the permute grad by the tokens' count; ours divides len(sorted_indices) by K."""
    if len(sorted_indices) != tokens_num * top_k:
        raise MoeOpError(
            f"torch_npu.{name}: len(sorted_indices) = {len(sorted_indices)} must be tokens ({tokens_num}) * "
            f"K ({top_k})",
            op_type=op_type,
        )


def _same_dtype(name: str, op_type: str, argument: str, wanted, got) -> None:
    if wanted != got:
        _refuse(op_type, name, argument, wanted, f"the gradient comes in {got}, and the op returns its dtype")


def npu_moe_token_permute_grad(tokens, grad_permuted_tokens, indices, sorted_indices, padded_mode=False):
    """torch_npu.npu_moe_token_permute_grad(Tensor tokens, Tensor grad_permuted_tokens, Tensor indices,
    Tensor sorted_indices, bool padded_mode=False) -> Tensor

    Source: Ascend/op-plugin, op_plugin/config/op_plugin_functions.yaml (``num_topK`` =
    ``indices.size(1)``, 1 for 1-D indices; output ``[tokens.size(0), H]`` of tokens' dtype).
    Runs ``cann.moe::MoeTokenPermuteGrad``: ``tokens`` gives the count and dtype only.
    """
    name, op_type = "npu_moe_token_permute_grad", "MoeTokenPermuteGrad"
    top_k = 1 if indices.dim() == 1 else indices.shape[1]
    _token_count(name, op_type, sorted_indices, top_k, tokens.shape[0])
    _same_dtype(name, op_type, "tokens.dtype", tokens.dtype, grad_permuted_tokens.dtype)
    return FUNCTIONS[op_type](grad_permuted_tokens, sorted_indices, num_topk=top_k, padded_mode=int(padded_mode))


def npu_moe_token_permute_grad_v2(
    grad_permuted_tokens, sorted_indices, tokens_size_0, tokens_dtype, num_topK, padded_mode=False
):
    """torch_npu.npu_moe_token_permute_grad_v2(Tensor grad_permuted_tokens, Tensor sorted_indices,
    int tokens_size_0, ScalarType tokens_dtype, int num_topK, bool padded_mode=False) -> Tensor

    Source: Ascend/op-plugin, op_plugin/config/op_plugin_functions.yaml; the backward of
    npu_moe_token_permute in op_plugin/config/derivatives.yaml. Runs ``cann.moe::MoeTokenPermuteGrad``.
    """
    name, op_type = "npu_moe_token_permute_grad_v2", "MoeTokenPermuteGrad"
    _token_count(name, op_type, sorted_indices, num_topK, tokens_size_0)
    _same_dtype(name, op_type, "tokens_dtype", tokens_dtype, grad_permuted_tokens.dtype)
    return FUNCTIONS[op_type](grad_permuted_tokens, sorted_indices, num_topk=num_topK, padded_mode=int(padded_mode))


def npu_moe_token_unpermute(permuted_tokens, sorted_indices, probs=None, padded_mode=False, restore_shape=None):
    """torch_npu.npu_moe_token_unpermute(Tensor permuted_tokens, Tensor sorted_indices,
    Tensor? probs=None, bool padded_mode=False, int[]? restore_shape=None) -> Tensor

    Source: Ascend/op-plugin, op_plugin/config/op_plugin_functions.yaml,
    op_plugin/ops/opapi/MoeTokenUnpermuteKernelNpuOpApi.cpp and op_plugin/utils/KernelNpuOutputSize.cpp
    (``len(sorted_indices) / K`` rows, K = probs.size(1) or 1). Runs ``cann.moe::MoeTokenUnpermute``;
    differentiable in permuted_tokens and probs (derivatives.yaml: npu_moe_token_unpermute_grad_v2).
    ``restore_shape`` is read only in padded mode, which is refused as on the NPU.
    """
    return FUNCTIONS["MoeTokenUnpermute"](
        permuted_tokens,
        sorted_indices,
        probs,
        padded_mode=int(padded_mode),
        restore_shape=None if restore_shape is None else [int(d) for d in restore_shape],
    )


def _npu_moe_token_unpermute(permuted_tokens, sorted_indices, probs=None, padded_mode=False, restore_shape=None):
    """torch_npu._npu_moe_token_unpermute(Tensor permuted_tokens, Tensor sorted_indices, Tensor? probs=None,
    bool padded_mode=False, int[]? restore_shape=None) -> (unpermuted_tokens, permuted_tokens_for_backward)

    Source: Ascend/op-plugin, op_plugin/ops/opapi/MoeTokenUnpermuteKernelNpuOpApi.cpp. The second
    output is ``permuted_tokens`` when probs are given and None (an undefined tensor) otherwise, as
    on CANN >= 8.1 before the 950 (the backward then needs no permuted rows).
    """
    unpermuted = npu_moe_token_unpermute(permuted_tokens, sorted_indices, probs, padded_mode, restore_shape)
    return unpermuted, permuted_tokens if probs is not None else None


def _no_probs_grad(grad, probs_grad):
    """op-plugin allocates grad_probs of size ``{}`` without probs (KernelNpuOutputSize.cpp,
    ``npu_moe_token_unpermute_grad_probs_out_size``): a 0-dim tensor, here 0 (SPEC-layer 1.12 (d)
    amended)."""
    return torch.zeros((), dtype=grad.dtype) if probs_grad is None else probs_grad


def npu_moe_token_unpermute_grad(
    permuted_tokens, grad_unpermuted_tokens, sorted_indices, probs=None, padded_mode=False, restore_shape=None
):
    """torch_npu.npu_moe_token_unpermute_grad(Tensor permuted_tokens, Tensor grad_unpermuted_tokens,
    Tensor sorted_indices, Tensor? probs=None, bool padded_mode=False, int[]? restore_shape=None)
    -> (grad_permuted_tokens, grad_probs)

    Source: Ascend/op-plugin, op_plugin/config/op_plugin_functions.yaml (grad_permuted_tokens has
    permuted_tokens' shape and dtype, grad_probs probs' shape and dtype). Runs
    ``cann.moe::MoeTokenUnpermuteGrad``; without probs ``grad_probs`` is a 0-dim tensor (0), as op-plugin sizes it.
    """
    name, op_type = "npu_moe_token_unpermute_grad", "MoeTokenUnpermuteGrad"
    _same_dtype(name, op_type, "permuted_tokens.dtype", permuted_tokens.dtype, grad_unpermuted_tokens.dtype)
    grad, probs_grad = FUNCTIONS[op_type](
        permuted_tokens,
        grad_unpermuted_tokens,
        sorted_indices,
        probs,
        padded_mode=int(padded_mode),
        restore_shape=None if restore_shape is None else [int(d) for d in restore_shape],
    )
    return grad, _no_probs_grad(grad, probs_grad)


def npu_moe_token_unpermute_grad_v2(
    grad_unpermuted_tokens,
    sorted_indices,
    permuted_tokens_size_0,
    permuted_tokens_dtype,
    probs=None,
    padded_mode=False,
    restore_shape=None,
    permuted_tokens=None,
):
    """torch_npu.npu_moe_token_unpermute_grad_v2(Tensor grad_unpermuted_tokens, Tensor sorted_indices,
    int permuted_tokens_size_0, ScalarType permuted_tokens_dtype, Tensor? probs=None, bool padded_mode=False,
    int[]? restore_shape=None, Tensor? permuted_tokens=None) -> (grad_permuted_tokens, grad_probs)

    Source: Ascend/op-plugin, op_plugin/config/op_plugin_functions.yaml; the backward of
    _npu_moe_token_unpermute in op_plugin/config/derivatives.yaml. Runs ``cann.moe::MoeTokenUnpermuteGrad``
    with ``permuted_tokens_num = permuted_tokens_size_0``; ``permuted_tokens`` is needed with probs.
    """
    name, op_type = "npu_moe_token_unpermute_grad_v2", "MoeTokenUnpermuteGrad"
    _same_dtype(name, op_type, "permuted_tokens_dtype", permuted_tokens_dtype, grad_unpermuted_tokens.dtype)
    grad, probs_grad = FUNCTIONS[op_type](
        permuted_tokens,
        grad_unpermuted_tokens,
        sorted_indices,
        probs,
        padded_mode=int(padded_mode),
        restore_shape=None if restore_shape is None else [int(d) for d in restore_shape],
        permuted_tokens_num=int(permuted_tokens_size_0),
    )
    return grad, _no_probs_grad(grad, probs_grad)


def npu_moe_init_routing(x, row_idx, expert_idx, active_num):
    """torch_npu.npu_moe_init_routing(Tensor x, Tensor row_idx, Tensor expert_idx, int active_num)
    -> (expanded_x, expanded_row_idx, expanded_expert_idx)

    Source: Ascend/op-plugin, docs/zh/custom_APIs/torch_npu/torch_npu-npu_moe_init_routing.md and
    op_plugin/ops/opapi/MoeInitRoutingKernelNpuOpApi.cpp. Runs ``cann.moe::MoeInitRouting``:
    ``expanded_x`` has ``min(active_num, T) * K`` rows; expert ids are not range-checked (a
    sentinel such as omni-infer's E sorts last). Not differentiable, as in torch_npu.

    Under ``torch.export`` with a dynamic token count, an ``active_num`` that is the token
    count (cann-recipes-infer's gpt-oss passes ``active_num=token_count``, omni-infer
    ``num_tokens``: symbolically ``expert_idx.shape[0]``) exports as ``active_num = 2^31 - 1``:
    ``min(active_num, T) = T`` at every T (the op-plugin clamps ``active_num`` to T the same
    way before calling aclnn). Any other symbolic ``active_num`` is refused.
    """
    if _follows(active_num, x.shape[0], expert_idx.shape[0], row_idx.shape[0]):
        active_num = INT32_MAX
    return FUNCTIONS["MoeInitRouting"](x, row_idx, expert_idx, active_num=active_num)


def npu_moe_compute_expert_tokens(sorted_expert_for_source_row, num_expert):
    """torch_npu.npu_moe_compute_expert_tokens(Tensor sorted_expert_for_source_row, int num_expert) -> Tensor

    Source: Ascend/op-plugin, op_plugin/config/op_plugin_functions.yaml (output size ``{num_expert}``,
    the input's dtype) and docs/zh/custom_APIs/torch_npu/torch_npu-npu_moe_compute_expert_tokens.md.
    Runs ``cann.moe::MoeComputeExpertTokens``: the inclusive cumsum of the per-expert counts (the
    exclusive end row of each expert), int32; ids >= num_expert are counted for no expert.
    """
    return FUNCTIONS["MoeComputeExpertTokens"](sorted_expert_for_source_row, num_experts=num_expert)


__all__ = [
    "_npu_moe_token_unpermute",
    "npu_moe_compute_expert_tokens",
    "npu_moe_init_routing",
    "npu_moe_token_permute",
    "npu_moe_token_permute_grad",
    "npu_moe_token_permute_grad_v2",
    "npu_moe_token_unpermute",
    "npu_moe_token_unpermute_grad",
    "npu_moe_token_unpermute_grad_v2",
]
