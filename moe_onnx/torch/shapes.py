"""Which outputs a call produces, and their sizes without running the kernel (fake tensors).

Both come from the OpDef's own ``infer``: it runs on the inputs' dtypes and shapes, where a
symbolic torch size (``s0``, ``u3``) is handed over by name exactly as ONNX hands over a
symbolic dim. What ONNX inference cannot say, torch can often still express:

* sizes that are a formula of the inputs' sizes (``SIZE_RULES``, e.g. ``T*K`` rows);
* sizes that depend on values (the rows an AllToAll receives): a new unbacked symbol.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..custom_ops import OPS
from ..custom_ops.opdef import OpDef, Output, TensorInfo
from .arrays import TORCH_DTYPES, dtype_name


def _world_size(sizes, attrs):
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else None


def _init_routing_rows(sizes, attrs):
    """Rows of MoeInitRoutingV2's expanded_x without drop/pad: T*K, or min(active_num, T*K)."""
    tokens, top_k = sizes["expert_idx"]
    rows = tokens * top_k
    return torch.sym_min(attrs["active_num"], rows) if attrs["active_num"] > 0 else rows


def _slots(sizes: dict, name: str):
    """T*K of a ``[T]`` or ``[T, K]`` input."""
    shape = sizes[name]
    return shape[0] if len(shape) == 1 else shape[0] * shape[1]


def _token_permute_rows(sizes, attrs):
    """Rows of MoeTokenPermute's permuted_tokens: F = T*K, min(n, F) or F + n (n = num_out_tokens)."""
    slots, n = _slots(sizes, "indices"), attrs["num_out_tokens"]
    return slots if n == 0 else torch.sym_min(n, slots) if n > 0 else slots + n


def _init_routing_v1_rows(sizes, attrs):
    """Rows of MoeInitRouting's expanded_x: min(active_num, T) * K (active_num counts tokens)."""
    tokens, top_k = sizes["expert_idx"]
    return torch.sym_min(attrs["active_num"], tokens) * top_k


def _init_routing_v3_rows(sizes, attrs):
    """Rows of MoeInitRoutingV3's expanded_x (and expanded_scale) without drop/pad: T*K, or
    min(active_num, T*K) when active_num > 0."""
    tokens, top_k = sizes["expert_idx"]
    rows = tokens * top_k
    return torch.sym_min(attrs["active_num"], rows) if attrs["active_num"] > 0 else rows


def _permute_rows(sizes, attrs):
    """Rows of the routing-map permute given ``num_out_tokens = -K``: T*K (None otherwise)."""
    return sizes["tokens"][0] * -attrs["num_out_tokens"] if attrs["num_out_tokens"] < 0 else None


def _finalize_rows(sizes, attrs):
    """Rows of MoeFinalizeRoutingV2's y: scales' R, else len(expanded_row_idx) / k."""
    return sizes["scales"][0] if "scales" in sizes else sizes["expanded_row_idx"][0] // attrs["k"]


def _finalize_grad_rows(sizes, attrs):
    """Rows of MoeFinalizeRoutingV2Grad's grad_expanded_x (dropless): min(active_num, R*K) or R*K."""
    slots = sizes["expanded_row_idx"][0]
    return torch.sym_min(attrs["active_num"], slots) if attrs["active_num"] > 0 else slots


def _mc2_rows(per_row: int = 1) -> Callable[[dict, dict], Any]:
    """A of the MC2 dispatch outputs (SPEC-mc2 1.19 b) for a symbolic BS and global_bs = 0:
    ``G = BS * W`` and the rank's capacity from it (times ``per_row``: assist_info's 128)."""

    def rows(sizes, attrs):
        from ..custom_ops.mc2 import placement_of

        v2 = "comm_alg" in attrs
        tokens, top_k = sizes["expert_ids"]
        if attrs["global_bs"] or not isinstance(top_k, int):
            return None
        place = placement_of(attrs, v2)
        return place.capacity(attrs["ep_rank_id"], tokens * place.world, top_k, v2) * per_row

    return rows


def _half(axis: int) -> Callable[[dict, dict], Any]:
    """SwiGlu's y along the halved axis: half of x's (symbolic) size there."""
    return lambda sizes, attrs: sizes["x"][axis] // 2


#: (op, output, axis) -> size from the inputs' sizes and the attributes, where ``infer`` says "unknown"
SIZE_RULES: dict[tuple[str, str, int], Callable[[dict, dict], Any]] = {
    ("MoeInitRoutingV2", "expanded_x", 0): _init_routing_rows,
    ("MoeInitRoutingV2", "expanded_row_idx", 0): lambda sizes, attrs: sizes["expert_idx"][0] * sizes["expert_idx"][1],
    ("MoeInitRoutingV2Grad", "grad_x", 0): lambda sizes, attrs: sizes["expanded_row_idx"][0] // attrs["top_k"],
    ("AllGather", "y", 0): _world_size,
    ("MoeTokenPermute", "permuted_tokens", 0): _token_permute_rows,
    ("MoeTokenPermute", "sorted_indices", 0): lambda sizes, attrs: _slots(sizes, "indices"),
    ("MoeTokenPermuteGrad", "input_grad", 0): lambda sizes, attrs: sizes["sorted_indices"][0] // attrs["num_topk"],
    ("MoeInitRouting", "expanded_x", 0): _init_routing_v1_rows,
    ("MoeInitRouting", "expanded_row_idx", 0): lambda sizes, attrs: _slots(sizes, "expert_idx"),
    ("MoeInitRouting", "expanded_expert_idx", 0): lambda sizes, attrs: _slots(sizes, "expert_idx"),
    ("MoeInitRoutingV3", "expanded_x", 0): _init_routing_v3_rows,
    ("MoeInitRoutingV3", "expanded_scale", 0): _init_routing_v3_rows,
    ("MoeInitRoutingV3", "expanded_row_idx", 0): lambda sizes, attrs: sizes["expert_idx"][0] * sizes["expert_idx"][1],
    ("MoeTokenPermuteWithRoutingMap", "permuted_tokens", 0): _permute_rows,
    ("MoeTokenPermuteWithRoutingMap", "sorted_indices", 0): _permute_rows,
    ("MoeTokenPermuteWithRoutingMap", "permuted_probs", 0): _permute_rows,
    ("MoeFinalizeRoutingV2", "y", 0): _finalize_rows,
    ("MoeFinalizeRoutingV2Grad", "grad_expanded_x", 0): _finalize_grad_rows,
    **{("SwiGlu", "y", axis): _half(axis) for axis in range(8)},
    **{
        (op, output, 0): _mc2_rows()
        for op in ("MoeDistributeDispatch", "MoeDistributeDispatchV2")
        for output in ("expand_x", "dynamic_scales", "expand_scales")
    },
    ("MoeDistributeDispatchV2", "assist_info_for_combine", 0): _mc2_rows(128),
    ("MoeDistributeDispatch", "expand_idx", 0): lambda sizes, attrs: _slots(sizes, "expert_ids"),
}


def present_outputs(op: OpDef, input_dtypes: Sequence[str | None], attrs: dict) -> list[bool]:
    """Which of ``op``'s outputs a call with these inputs (their dtype names, None = absent)
    and attributes produces. Also checks the attributes (MoeOpError)."""
    return list(_present(op.name, tuple(input_dtypes), tuple(sorted(attrs.items()))))


#: An exported node names every output the op declares before its last present one, so a
#: middle optional output cannot be left out; these attribute values make it present
#: (computed, then unused) instead.
FILL_MIDDLE_OUTPUT = {
    ("MoeInitRoutingV2", "expert_tokens_count_or_cumsum"): {"expert_tokens_count_or_cumsum_flag": 2},
    # (count type 1: allowed in every mode)
    ("MoeInitRoutingV3", "expert_tokens_count_or_cumsum"): {"expert_tokens_num_flag": 1, "expert_tokens_num_type": 1},
}


def node_outputs(op: OpDef, input_dtypes: Sequence[str | None], attrs: dict) -> tuple[list[bool], int, dict]:
    """What an exported node of ``op`` needs (both exporters): which outputs the call produces,
    how many outputs the node names (up to the last present one; trailing absent ones are left
    out), and the bound attributes, with ``FILL_MIDDLE_OUTPUT`` applied."""
    attrs = op.bind_attrs(attrs)
    present = present_outputs(op, input_dtypes, attrs)
    named = max(i for i, keep in enumerate(present) if keep) + 1
    for i in range(named):
        if not present[i]:
            fill = FILL_MIDDLE_OUTPUT.get((op.name, op.outputs[i].name))
            if fill is None:
                raise NotImplementedError(f"{op.name}: cannot export without output {op.outputs[i].name} here")
            attrs.update(fill)
    return present, named, attrs


@torch.compiler.assume_constant_result  # torch.compile: a constant of the dtypes and attributes
def _present(op_type: str, input_dtypes: tuple, attrs: tuple) -> tuple:
    op = OPS[op_type]
    infos = [None if dtype is None else TensorInfo(dtype, None) for dtype in input_dtypes]
    produced = op.signature(infos, dict(attrs)).outputs
    return tuple(o.name in produced for o in op.outputs)


def placeholder(output: Output, device=None) -> torch.Tensor:
    """What the torch op returns for an absent optional output: an empty tensor."""
    return torch.empty(0, dtype=TORCH_DTYPES[output.dtypes[0]], device=device)


def fake_outputs(op: OpDef, inputs: Sequence[torch.Tensor | None], attrs: dict) -> list[torch.Tensor]:
    """Empty tensors of the dtypes and sizes ``op`` will return (run on fake/meta tensors)."""
    symbols: dict[str, Any] = {}

    def dims(tensor: torch.Tensor) -> tuple:
        out: list[int | str] = []
        sizes: Sequence[Any] = tensor.shape  # SymInts under fake tensors, though typed int
        for d in sizes:
            if isinstance(d, int):
                out.append(d)
            else:
                symbols[str(d)] = d
                out.append(str(d))
        return tuple(out)

    infos = [None if t is None else TensorInfo(dtype_name(t.dtype), dims(t)) for t in inputs]
    sig = op.signature(infos, attrs)
    sizes = {decl.name: tuple(t.shape) for decl, t in zip(op.inputs, inputs) if t is not None}
    device = next(t.device for t in inputs if t is not None)
    results = []
    for decl in op.outputs:
        info = sig.outputs.get(decl.name)
        if info is None:
            results.append(placeholder(decl, device))
            continue
        assert info.shape is not None and info.dtype is not None, f"{op.name}: {decl.name} untyped from typed inputs"
        shape: list[Any] = []
        for axis, d in enumerate(info.shape):
            if isinstance(d, int):
                shape.append(d)
            elif isinstance(d, str) and d in symbols:
                shape.append(symbols[d])
            else:
                rule = SIZE_RULES.get((op.name, decl.name, axis))
                size = None if rule is None else rule(sizes, sig.attrs)
                shape.append(torch.library.get_ctx().new_dynamic_size() if size is None else size)
        results.append(torch.empty(shape, dtype=TORCH_DTYPES[info.dtype], device=device))
    return results
