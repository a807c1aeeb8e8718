"""torch_npu's names of expert compute and combine (SPEC-layer 1.8-1.10): grouped matmul,
SwiGLU and its backward, finalize routing (the weight-format casts are in ``layout``).

``npu_grouped_matmul`` maps op-plugin's list signature onto the one ``GroupedMatmul`` node
(SPEC-layer, decisions): one 3-D weight is used as it is, a list of E 2-D weights of one shape
is stacked (a copy), a list of x with ``group_type`` 0 is concatenated and the output split
back; ``group_type`` -1 runs one node per (x, weight) pair. A weight or x that is a transposed
view (op-plugin's ``is_weight_trans``: what ``w.transpose(1, 2)`` of a contiguous weight gives)
is passed as its contiguous storage with ``transpose_weight`` / ``transpose_x``, so nothing is
copied.
"""

from __future__ import annotations

import torch

from ...custom_ops import MoeOpError
from ..ops import FUNCTIONS
from .common import refuse as _refuse

_GMM = "GroupedMatmul"
_NAME = "npu_grouped_matmul"
#: op-plugin's quantisation and activation-input arguments: none has a CPU golden here
_QUANTISED = (
    "scale",
    "offset",
    "antiquant_scale",
    "antiquant_offset",
    "per_token_scale",
    "activation_input",
    "activation_quant_scale",
    "activation_quant_offset",
)
_DTYPE_ARGUMENTS = ("x_dtype", "weight_dtype", "scale_dtype", "per_token_scale_dtype")
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_MISSING = object()


def _is_transposed(tensor: torch.Tensor) -> bool:
    """op-plugin's ``is_weight_trans``: the last two axes are a transposed contiguous pair."""
    if tensor.dim() < 2 or tensor.size(-1) == 1 or tensor.size(-2) == 1:
        return False
    return tensor.stride(-2) == 1 and tensor.stride(-1) == tensor.size(-2)


def _stored(tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(tensor as the node takes it, transposed flag)``: a transposed view is passed as its
    contiguous storage (the last two axes swapped back) with the flag set."""
    if _is_transposed(tensor):
        swapped = tensor.transpose(-1, -2)
        if swapped.is_contiguous():
            return swapped, 1
    return tensor, 0


def _as_list(value) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _refuse_unsupported(x: list, weight: list, arguments: dict) -> None:
    for name in _QUANTISED:
        if arguments[name] is not None:
            _refuse(_GMM, _NAME, name, "<tensors>", "no quantised or activation-input grouped matmul")
    for name in _DTYPE_ARGUMENTS:
        if arguments[name] is not None:
            _refuse(_GMM, _NAME, name, arguments[name], "x and weight are read as their own float dtypes")
    if arguments["act_type"] not in (None, 0):
        _refuse(_GMM, _NAME, "act_type", arguments["act_type"], "no fused activation (apply it after the product)")
    if arguments["group_list_type"] == 2:
        _refuse(_GMM, _NAME, "group_list_type", 2, "[E, 2] (group index, size) pairs are the quantised int8 form")
    for what, tensors in (("x", x), ("weight", weight)):
        for t in tensors:
            if t.dtype not in _FLOATS:
                why = "int4 packed in int32 (FRACTAL_NZ weights)" if t.dtype == torch.int32 else "quantised values"
                _refuse(_GMM, _NAME, what, f"<{t.dtype} tensor>", f"float32/float16/bfloat16 only, not {why}")
    output_dtype = arguments["output_dtype"]
    if output_dtype is not None and output_dtype != x[0].dtype:
        _refuse(_GMM, _NAME, "output_dtype", output_dtype, f"y has x's dtype ({x[0].dtype})")


def _group_list(group_list, group_type):
    """``(group_list tensor or None, group_list_type forced or None)``: op-plugin's List[int]
    overload (aclnnGroupedMatmul) takes the cumsum of x's rows."""
    if group_list is None or isinstance(group_list, torch.Tensor):
        return group_list, None
    return torch.tensor(list(group_list), dtype=torch.int64), 0


def _stacked(weight: list) -> torch.Tensor:
    """One ``[E, K, N]`` weight: a single 3-D tensor as it is, E 2-D tensors of one shape stacked."""
    if len(weight) == 1 and weight[0].dim() == 3:
        return weight[0]
    shapes = {tuple(w.shape) for w in weight}
    if len(shapes) != 1 or any(w.dim() != 2 for w in weight):
        _refuse(
            _GMM,
            _NAME,
            "weight",
            f"<{len(weight)} tensors of shapes {sorted(shapes)}>",
            "grouped weights must have one 2-D shape (they are stacked into [E, K, N]); "
            "use group_type=-1 for independent products",
        )
    return torch.stack(weight)


def npu_grouped_matmul(
    x,
    weight,
    *,
    bias=None,
    scale=None,
    offset=None,
    antiquant_scale=None,
    antiquant_offset=None,
    per_token_scale=None,
    group_list=None,
    activation_input=None,
    activation_quant_scale=None,
    activation_quant_offset=None,
    split_item=0,
    group_type=None,
    group_list_type=0,
    act_type=0,
    output_dtype=None,
    tuning_config=None,
    x_dtype=None,
    weight_dtype=None,
    scale_dtype=None,
    per_token_scale_dtype=None,
):
    """torch_npu.npu_grouped_matmul(Tensor[] x, Tensor[] weight, *, Tensor[]? bias=None,
    Tensor[]? scale=None, Tensor[]? offset=None, Tensor[]? antiquant_scale=None,
    Tensor[]? antiquant_offset=None, Tensor[]? per_token_scale=None, Any group_list=None,
    Tensor[]? activation_input=None, Tensor[]? activation_quant_scale=None,
    Tensor[]? activation_quant_offset=None, int? split_item=0, int? group_type=None,
    int? group_list_type=0, int? act_type=0, int[]? tuning_config=None, int? output_dtype=None,
    int? x_dtype=None, int? weight_dtype=None, int? scale_dtype=None,
    int? per_token_scale_dtype=None) -> Tensor[]

    Source: Ascend/op-plugin, op_plugin/config/op_plugin_functions.yaml (the Tensor and the
    List[int] group_list overloads: ``Any group_list`` above stands for ``Tensor?`` or ``int[]?``),
    op_plugin/ops/opapi/GroupedMatmulKernelNpuOpApi.cpp (output sizes),
    docs/zh/custom_APIs/torch_npu/torch_npu-npu_grouped_matmul.md.
    Runs ``cann.moe::GroupedMatmul`` (see the module doc for how lists map onto it).

    * ``group_type`` is required (the OpApi rejects None), except with a ``List[int]``
      group_list (the old overload: a cumsum over x's rows, group_type 0).
    * ``split_item`` 0/1: one tensor per group (type 0: group e's rows; type 2: ``y[e]``;
      type -1: one per pair); 2/3: one tensor (type 0: ``[M, N]``, rows past the groups 0;
      type 2: ``[E, M, N]``; type -1: the pairs' outputs concatenated along rows).
      torch_npu sizes the 0/1 outputs by differencing group_list even with
      ``group_list_type`` 1; here they follow the counts.
    * ``tuning_config`` is a tiling hint: accepted and ignored. Refused by name: the
      quantisation and activation-input arguments, ``act_type`` != 0, ``group_list_type`` 2,
      the dtype arguments, ``output_dtype`` other than x's, non-float x or weight (int8, int4
      packed in int32 as FRACTAL_NZ weights take it, fp8, fp4).
    """
    del tuning_config  # a tiling hint of the NPU
    xs, weights = _as_list(x), _as_list(weight)
    _refuse_unsupported(xs, weights, locals())
    if group_list_type is None:
        group_list_type = 0
    group_list, forced_type = _group_list(group_list, group_type)
    if forced_type is not None:
        group_type = 0 if group_type is None else group_type
        group_list_type = forced_type
    if group_type is None:
        _refuse(_GMM, _NAME, "group_type", None, "it must be given (-1, 0 or 2; torch_npu rejects None)")
    split_item = 0 if split_item is None else split_item
    if split_item not in (0, 1, 2, 3):  # the node is always given 3: check the caller's value here
        raise MoeOpError(f"torch_npu.{_NAME}: split_item must be 0, 1, 2 or 3, got {split_item!r}", op_type=_GMM)
    biases = None if bias is None else _as_list(bias)
    if group_type == -1:
        return _independent_products(xs, weights, biases, group_list, split_item)
    if len(xs) > 1 and group_type == 0:
        sizes = [len(t) for t in xs]
        if group_list is None:
            group_list, group_list_type = torch.tensor(sizes).cumsum(0), 0
        rows = torch.cat(xs)
    else:
        sizes, rows = None, xs[0]
    stacked = _stacked(weights) if group_type == 0 else weights[0]
    if biases is not None and group_type == 0:
        biases = [biases[0] if len(biases) == 1 and biases[0].dim() == 2 else torch.stack(biases)]
    node_weight, transpose_weight = _stored(stacked)
    node_x, transpose_x = _stored(rows) if group_type == 2 else (rows, 0)
    y = FUNCTIONS[_GMM](
        node_x,
        node_weight,
        None if biases is None else biases[0],
        group_list,
        group_type=group_type,
        group_list_type=group_list_type,
        split_item=3,
        transpose_weight=transpose_weight,
        transpose_x=transpose_x,
    )
    if split_item in (2, 3):
        return [y]
    if group_type == 2:
        return list(y.unbind(0))
    if sizes is None:
        counts = group_list if group_list_type == 1 else torch.diff(group_list, prepend=group_list.new_zeros(1))
        sizes = counts.tolist()
    return list(torch.split(y[: sum(sizes)], sizes))


def _independent_products(xs: list, weights: list, biases: list | None, group_list, split_item: int) -> list:
    """group_type -1: ``y_i = x_i @ w_i + bias_i`` per pair (x_i of 2-6 dims with split_item 0/1)."""
    if group_list is not None:
        _refuse(_GMM, _NAME, "group_list", "<tensor>", "group_type -1 takes none (independent products)")
    if len(xs) != len(weights) or (biases is not None and len(biases) != len(xs)):
        _refuse(
            _GMM,
            _NAME,
            "weight",
            f"<{len(weights)} tensors for {len(xs)} x>",
            "group_type -1 takes one weight (and bias) per x",
        )
    outputs = []
    for i, (x_i, w_i) in enumerate(zip(xs, weights)):
        node_weight, transpose_weight = _stored(w_i)
        flat = x_i.reshape(-1, x_i.shape[-1])
        y = FUNCTIONS[_GMM](
            flat,
            node_weight,
            None if biases is None else biases[i],
            group_type=-1,
            split_item=3,
            transpose_weight=transpose_weight,
        )
        outputs.append(y.reshape(*x_i.shape[:-1], y.shape[-1]))
    if split_item in (0, 1):
        return outputs
    shapes = [list(y.shape) for y in outputs]
    if any(len(shape) != 2 for shape in shapes) or len({shape[-1] for shape in shapes}) > 1:
        raise MoeOpError(
            f"torch_npu.{_NAME}: split_item {split_item} with group_type -1 concatenates the products along "
            f"rows, so each x must be 2-D and every weight have one N; the products are {shapes}",
            op_type=_GMM,
        )
    return [torch.cat(outputs)]


def npu_swiglu(input, dim=-1):  # noqa: A002 - torch_npu's keyword
    """torch_npu.npu_swiglu(Tensor self, int dim=-1) -> Tensor (Python keyword ``input``)

    Source: Ascend/op-plugin, op_plugin/config/op_plugin_functions.yaml (aclnnSwiGlu),
    docs/zh/custom_APIs/torch_npu/（beta）torch_npu-npu_swiglu.md. Runs ``cann.moe::SwiGlu``:
    ``a * sigmoid(a) * b`` of the two halves along ``dim`` (the first half is the gate).
    Differentiable (op-plugin derivatives.yaml: ``npu_swiglu_backward``).
    """
    return FUNCTIONS["SwiGlu"](input, dim=dim)


def npu_swiglu_backward(grad_output, input, dim=-1):  # noqa: A002 - torch_npu's keyword
    """torch_npu.npu_swiglu_backward(Tensor grad_output, Tensor self, int dim=-1) -> Tensor
    (Python keyword ``input``)

    Source: Ascend/op-plugin, op_plugin/config/op_plugin_functions.yaml (aclnnSwiGluGrad;
    the output has ``self``'s size and dtype). Runs ``cann.moe::SwiGluGrad``.
    """
    return FUNCTIONS["SwiGluGrad"](grad_output, input, dim=dim)


def npu_moe_finalize_routing(
    expanded_permuted_rows,
    skip1,
    skip2,
    bias,
    scales,
    expanded_src_to_dst_row,
    export_for_source_row=_MISSING,
    drop_pad_mode=0,
    k=1,
    *,
    expert_for_source_row=_MISSING,
):
    """torch_npu.npu_moe_finalize_routing(Tensor expanded_permuted_rows, Tensor? skip1,
    Tensor? skip2, Tensor? bias, Tensor? scales, Tensor expanded_src_to_dst_row,
    Tensor? export_for_source_row, int? drop_pad_mode=0, int? k=1) -> Tensor

    Source: Ascend/op-plugin, op_plugin/config/op_plugin_functions.yaml,
    op_plugin/ops/opapi/MoeFinalizeRoutingV2KernelNpuOpApi.cpp,
    docs/zh/custom_APIs/torch_npu/torch_npu-npu_moe_finalize_routing.md.
    Runs ``cann.moe::MoeFinalizeRoutingV2`` (skip1 -> x1, skip2 -> x2,
    expanded_src_to_dst_row -> expanded_row_idx, export_for_source_row -> expert_idx).
    The yaml's keyword is ``export_for_source_row`` (what omni-infer and cann-recipes-infer
    pass); the doc's ``expert_for_source_row`` is accepted too (one of them is required, as
    the other tensors are: None is a value). ``drop_pad_mode`` / ``k`` None mean 0 / 1.
    Differentiable here in the rows and scales (MoeFinalizeRoutingV2Grad), not in torch_npu.
    """
    given = [v for v in (export_for_source_row, expert_for_source_row) if v is not _MISSING]
    if not given:
        raise TypeError("npu_moe_finalize_routing() missing required argument 'export_for_source_row'")
    if len(given) == 2:
        raise TypeError(
            "npu_moe_finalize_routing() got both export_for_source_row and expert_for_source_row (the same argument)"
        )
    return FUNCTIONS["MoeFinalizeRoutingV2"](
        expanded_permuted_rows,
        expanded_src_to_dst_row,
        skip1,
        skip2,
        bias,
        scales,
        given[0],
        drop_pad_mode=0 if drop_pad_mode is None else drop_pad_mode,
        k=1 if k is None else k,
    )


__all__ = [
    "npu_grouped_matmul",
    "npu_moe_finalize_routing",
    "npu_swiglu",
    "npu_swiglu_backward",
]
