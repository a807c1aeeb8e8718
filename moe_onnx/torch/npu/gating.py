"""torch_npu's names of the gating operators (SPEC 1.13, 1.14): softmax top-k, the grouped
(DeepSeek-V3 ``noaux_tc``) and hash top-k, and the sigmoid top-k backward."""

from __future__ import annotations

from ..ops import FUNCTIONS
from .common import refuse as _refuse


def _int(value):
    """A Python bool as the int attribute it means (``renorm=True`` is 1, SPEC 1.18)."""
    return int(value) if isinstance(value, bool) else value


def npu_moe_gating_top_k_softmax(x, finished=None, k=1):
    """torch_npu.npu_moe_gating_top_k_softmax(Tensor x, Tensor? finished=None, int k=1)
    -> (y, expert_idx, row_idx)

    Source: Ascend/op-plugin, op_plugin/config/op_plugin_functions.yaml and
    docs/zh/custom_APIs/torch_npu/torch_npu-npu_moe_gating_top_k_softmax.md
    (MoeGatingTopKSoftmaxKernelNpuOpApi.cpp). Runs ``cann.moe::MoeGatingTopKSoftmax``: ``x``
    ``[N, E]`` or ``[B, S, E]``; ``y`` the k largest softmax probabilities (dtype of x, not
    renormalised), ``expert_idx`` int32 (E for finished rows), ``row_idx`` int32 the
    column-major slot ``j*n + r`` that ``npu_moe_init_routing`` takes. Not differentiable, as
    in torch_npu. The op-plugin accepts ``k = 0`` (empty outputs); the ONNX op needs ``k >= 1``.
    """
    return FUNCTIONS["MoeGatingTopKSoftmax"](x, finished, k=k)


def npu_moe_gating_top_k(
    x,
    k,
    *,
    bias=None,
    input_ids=None,
    tid2eid=None,
    k_group=1,
    group_count=1,
    group_select_mode=0,
    renorm=0,
    norm_type=0,
    out_flag=False,
    routed_scaling_factor=1.0,
    eps=1e-20,
):
    """torch_npu.npu_moe_gating_top_k(Tensor x, int k, *, Tensor? bias=None, Tensor? input_ids=None,
    Tensor? tid2eid=None, int k_group=1, int group_count=1, int group_select_mode=0, int renorm=0,
    int norm_type=0, bool out_flag=False, float routed_scaling_factor=1.0, float eps=1e-20)
    -> (y, expert_idx, out)

    Source: Ascend/op-plugin, op_plugin/config/op_plugin_functions.yaml,
    op_plugin/ops/opapi/MoeGatingTopKKernelNpuOpApi.cpp (aclnnMoeGatingTopKV2 when both hash
    inputs are given) and derivatives.yaml. Runs ``cann.moe::MoeGatingTopK``. ``out`` [T, E]
    float32 holds the scores whatever ``out_flag`` (the NPU leaves it unwritten without it).

    Differentiable in ``x`` (y only, as derivatives.yaml says) through
    ``npu_moe_gating_top_k_backward``, for ``norm_type=1`` (sigmoid) and ``out_flag=True``:
    the backward reads ``out``, which the NPU writes only with the flag, so a backward after
    ``out_flag=False`` raises here instead of computing from memory the NPU never wrote.
    """
    return FUNCTIONS["MoeGatingTopK"](
        x,
        bias,
        input_ids,
        tid2eid,
        k=k,
        k_group=k_group,
        group_count=group_count,
        group_select_mode=_int(group_select_mode),
        renorm=_int(renorm),
        norm_type=_int(norm_type),
        out_flag=_int(out_flag),
        routed_scaling_factor=float(routed_scaling_factor),
        eps=float(eps),
    )


def npu_moe_gating_top_k_backward(
    x_norm, grad_y, expertIdx, *, renorm=0, norm_type=0, routed_scaling_factor=1.0, eps=1e-20
):  # noqa: N803 - op-plugin's keyword name
    """torch_npu.npu_moe_gating_top_k_backward(Tensor x_norm, Tensor grad_y, Tensor expertIdx, *,
    int renorm=0, int norm_type=0, float routed_scaling_factor=1.0, float eps=1e-20) -> Tensor

    Source: Ascend/op-plugin, op_plugin/config/op_plugin_functions.yaml (aclnnMoeGatingTopKBackward;
    the output has the size of x_norm and the dtype of grad_y). Runs
    ``cann.moe::MoeGatingTopKBackward``. The yaml's default ``norm_type=0`` is refused by name:
    the NPU's backward exists for the sigmoid scores (``norm_type=1``) only.
    """
    if norm_type != 1:
        _refuse(
            "MoeGatingTopKBackward",
            "npu_moe_gating_top_k_backward",
            "norm_type",
            norm_type,
            "the backward exists for the sigmoid scores only (norm_type=1)",
        )
    return FUNCTIONS["MoeGatingTopKBackward"](
        x_norm,
        grad_y,
        expertIdx,
        renorm=_int(renorm),
        norm_type=norm_type,
        routed_scaling_factor=float(routed_scaling_factor),
        eps=float(eps),
    )


__all__ = ["npu_moe_gating_top_k", "npu_moe_gating_top_k_backward", "npu_moe_gating_top_k_softmax"]
