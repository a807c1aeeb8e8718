"""MoeGatingTopK: scores, optional grouped selection, the k best experts (SPEC 1.14), with the
hash mode of aclnnMoeGatingTopKV2.

Shapes. ``x [T, E]``, ``bias [E]`` (dtype of x), ``input_ids [T]`` and ``tid2eid [V, k]``
(int32 or int64). Outputs ``y [T, k]`` (dtype of x), ``expert_idx [T, k]`` int32 (token, slot
-> expert), ``out [T, E]`` float32 (the scores, token-major).

    s = f32(softmax / sigmoid / sqrt(softplus) of x)     norm_type 0 / 1 / 2 (float64, rounded once)
    v = s + f32(bias)                                    float32; the selection value only
    hash mode (input_ids and tid2eid given): expert_idx = tid2eid[input_ids]   (no selection: bias unused)
    otherwise:
      group_count G > 1 and k_group < G: score each group g (experts g*E/G ..) by the max of
        its v (group_select_mode 0) or the sum of its two largest v (mode 1); keep the
        k_group best groups (equal scores: the lower group) and choose among their experts only
      expert_idx = the k best experts by v, descending; equal v -> lower expert
    w = s[expert_idx]                                    the unbiased scores
    y = f32(w / (sum(w) + eps) * routed_scaling_factor)  if norm_type is 1 or 2, or renorm = 1
        f32(w * routed_scaling_factor)                   otherwise; float64, rounded once
    out = s

Choices where CANN's documents disagree or are silent (SPEC 1.14 lists the contradictions):

* Dropped groups are never chosen. SPEC's reference fills them with -inf, which is the same
  whenever the kept groups hold k values above -inf; with -inf or NaN values in a kept group
  (NaN ranks as -inf) the -inf fill could hand a dropped group's expert the tie. HF's
  DeepSeek-V3 gate fills with 0.0 instead, so it can pick a dropped expert when biased
  scores are negative; here it never does.
* ``renorm = 1`` renormalises the softmax (the new aclnn doc); the torch doc reads renorm as an
  ordering and allows only 0, so the target check flags renorm = 1. A sigmoid or sqrt-softplus
  result is always renormalised (vllm-ascend refuses sigmoid without renormalisation).
* ``out`` is always written. The NPU writes it only with ``out_flag``; torch_npu allocates it
  anyway, so a comparison masks it then. Its gradient (MoeGatingTopKBackward) reads it.
* Hash mode: every input id must lie in ``[0, V)`` and every ``tid2eid`` entry used must be
  an expert in ``[0, E)`` (the NPU would read outside its tensors); an expert may appear twice
  in a row, and its weight then counts twice in the sum.
"""

from __future__ import annotations

import numpy as np

from . import buffers, gating
from .dtypes import FLOATS, INDEX
from .errors import BAD_DTYPE, MoeOpError
from .opdef import Attr, Example, Input, OpDef, Output, Signature
from .targets import Target, align32, known_dim

MAX_EXPERTS = 2048
MAX_HASH_K = 64


def _hash_experts(input_ids: np.ndarray, tid2eid: np.ndarray, experts: int) -> np.ndarray:
    """``[T, k]`` int32 ``tid2eid[input_ids]``, every id and expert checked."""
    rows = len(tid2eid)
    bad = np.flatnonzero((input_ids < 0) | (input_ids >= rows))
    if len(bad):
        t = int(bad[0])
        raise MoeOpError(f"input_ids must be in [0, V) = [0, {rows}) (rows of tid2eid), got {input_ids[t]} at [{t}]")
    chosen = tid2eid[input_ids]
    bad = np.flatnonzero((chosen < 0) | (chosen >= experts))
    if len(bad):
        t, j = divmod(int(bad[0]), chosen.shape[1])
        raise MoeOpError(
            f"tid2eid entries must be experts in [0, E) = [0, {experts}), got {chosen[t, j]} at "
            f"tid2eid[{input_ids[t]}, {j}] (input_ids[{t}])"
        )
    return chosen.astype(np.int32)


def moe_gating_top_k(
    x,
    bias=None,
    input_ids=None,
    tid2eid=None,
    *,
    k,
    k_group=1,
    group_count=1,
    group_select_mode=0,
    renorm=0,
    norm_type=0,
    out_flag=0,
    routed_scaling_factor=1.0,
    eps=1e-20,
):
    """The k experts of each token (the module docstring's rule).

    Args:
        x: ``[T, E]`` float32/float16/bfloat16 logits.
        bias: ``[E]`` in the dtype of x, added to the scores for the selection only; or None.
        input_ids, tid2eid: ``[T]`` and ``[V, k]`` int32/int64, both or neither (hash mode).
        k, k_group, group_count, group_select_mode, renorm, norm_type, routed_scaling_factor,
        eps: as in the module docstring. out_flag: recorded for the NPU (``out`` is always written).
    Returns:
        ``y [T, k]`` (dtype of x), ``expert_idx [T, k]`` int32 (token, slot -> expert),
        ``out [T, E]`` float32 scores.
    """
    tokens, experts = x.shape
    out = buffers.empty((tokens, experts), np.float32)
    hashed = None if input_ids is None else _hash_experts(input_ids, tid2eid, experts)
    expert_idx, weights = gating.gate(
        x,
        norm_type,
        k,
        offset=None if bias is None else bias.astype(np.float32),
        groups=group_count,
        k_group=k_group,
        top_two=group_select_mode == 1,
        hashed=hashed,
        normalise=norm_type in (gating.SIGMOID, gating.SQRT_SOFTPLUS) or renorm == 1,
        scale=routed_scaling_factor,
        eps=eps,
        scores=out,
    )
    y = buffers.empty((tokens, k), x.dtype)
    y[...] = weights  # round to nearest even
    return y, expert_idx, out


def _infer(sig: Signature) -> None:
    x = sig.input("x")
    tokens, experts = sig.dim("x", 0), sig.dim("x", 1)
    k, k_group, groups = sig.attr("k"), sig.attr("k_group"), sig.attr("group_count")
    mode = sig.attr("group_select_mode")
    sig.require(groups >= 1, f"group_count must be >= 1, got {groups}")
    sig.require(1 <= k_group <= groups, f"k_group must be in [1, group_count] = [1, {groups}], got {k_group}")
    sig.require(k >= 1, f"k must be >= 1, got {k}")
    per_group = sig.quotient(experts, groups, "E (x dim 1) must be a multiple of group_count")
    if per_group is None:  # E symbolic: both rules as lower bounds on E, checked at run time
        for least, rule in (
            (groups * (mode + 1), "E/group_count must exceed group_select_mode"),
            (groups * -(-k // k_group), "k must be in [1, k_group*E/group_count]"),
        ):
            sig.require(least < 2**63, f"{rule}: that needs E >= {least}, more than a tensor holds")
            sig.defer("at_most", (least, experts), rule)
    else:
        sig.require(
            per_group > mode,
            f"E/group_count = {per_group} experts per group must exceed group_select_mode = {mode}",
        )
        sig.require(
            k <= k_group * per_group,
            f"k must be in [1, k_group*E/group_count] = [1, {k_group * per_group}], got {k}",
        )
    if sig.has("bias"):
        sig.require(
            sig.input("bias").dtype in (None, x.dtype),
            f"bias must have the dtype of x ({x.dtype}), got {sig.input('bias').dtype}",
            BAD_DTYPE,
        )
        bias_shape = sig.input("bias").shape
        if bias_shape is not None:
            sig.require(len(bias_shape) == 1, f"bias must be [E], got shape {list(bias_shape)}")
            sig.same(bias_shape[0], experts, "bias [E] must match x [T, E]")
    if sig.has("input_ids") != sig.has("tid2eid"):
        sig.fail("input_ids and tid2eid select the hash mode together: give both or neither")
    if sig.has("input_ids"):
        sig.same(sig.dim("input_ids", 0), tokens, "input_ids [T] must match x [T, E]")
        width = sig.dim("tid2eid", 1)
        if isinstance(width, int):
            sig.require(width == k, f"tid2eid [V, k] must have k = {k} columns, got {width}")
        else:
            sig.defer("equal", (width, k), "tid2eid [V, k] must have k columns")
    sig.output("y", x.dtype, (tokens, k))
    sig.output("expert_idx", "int32", (tokens, k))
    sig.output("out", "float32", (tokens, experts))


def _npu_limits(sig: Signature, target: Target) -> list[str]:
    """aclnnMoeGatingTopK(V2).md and torch_npu-npu_moe_gating_top_k.md."""
    found = []
    tokens, experts = known_dim(sig, "x", 0), known_dim(sig, "x", 1)
    k, k_group, groups = sig.attr("k"), sig.attr("k_group"), sig.attr("group_count")
    if tokens == 0:
        found.append("empty x (T = 0) is not supported")
    if experts is not None:
        per_group = experts // groups
        if experts > MAX_EXPERTS:
            found.append(f"E = {experts} exceeds {MAX_EXPERTS}")
        elif align32(per_group) * groups > MAX_EXPERTS:
            found.append(f"align32(E/group_count) * group_count = {align32(per_group) * groups} exceeds {MAX_EXPERTS}")
        if per_group <= 2:
            found.append(f"E/group_count = {per_group} experts per group: the torch doc requires more than 2")
    if sig.attr("renorm") != 0:
        found.append("renorm = 1: the torch doc supports renorm = 0 only (aclnn: renormalised softmax)")
    if sig.attr("norm_type") == 2 and target.name in ("ascend910b", "ascend910_93"):
        if groups != 1 or sig.attr("renorm") != 0:  # the A2/A3 tilings (SPEC-layer 1.14 (b) amended)
            found.append(
                f"norm_type = 2 (sqrt_softplus) needs group_count = 1 and renorm = 0 on A2/A3, "
                f"got group_count {groups}, renorm {sig.attr('renorm')}"
            )
    if sig.has("input_ids"):
        if k > MAX_HASH_K:
            found.append(f"hash mode: k = {k} exceeds {MAX_HASH_K}")
        if k_group != groups and groups != experts:
            found.append(
                f"hash mode needs k_group == group_count or group_count == E, got k_group {k_group}, "
                f"group_count {groups}, E {experts}"
            )
    return found


#: the 2 best of 4 experts by sigmoid (DeepSeek-V3's gate), renormalised
_EXAMPLE = Example(
    inputs={
        "x": np.array([[0.1, 2.0, -1.0, 0.5], [1.5, 0.0, 0.3, 1.2], [0.0, 0.0, 3.0, 1.0]], np.float32),
    },
    attrs={"k": 2, "norm_type": 1, "out_flag": 1},
)


MOE_GATING_TOP_K = OpDef(
    "MoeGatingTopK",
    __doc__,
    inputs=[
        Input("x", FLOATS, "[T, E] gating logits", (2,)),
        Input("bias", FLOATS, "[E] added to the scores for the selection (dtype of x)", (1,), optional=True),
        Input("input_ids", INDEX, "[T] token ids (hash mode, with tid2eid)", (1,), optional=True),
        Input("tid2eid", INDEX, "[V, k] token id -> its k experts (hash mode)", (2,), optional=True),
    ],
    outputs=[
        Output("y", FLOATS, "[T, k] weights of the chosen experts, best first (dtype of x)"),
        Output("expert_idx", ("int32",), "[T, k] (token, slot) -> expert"),
        Output("out", ("float32",), "[T, E] the scores s (written whatever out_flag)"),
    ],
    attrs=[
        Attr("k", "int", None, "experts per token, 1 <= k <= k_group*E/group_count", required=True),
        Attr("k_group", "int", 1, "groups kept, 1 <= k_group <= group_count"),
        Attr("group_count", "int", 1, "G, groups of E/G consecutive experts"),
        Attr("group_select_mode", "int", 0, "group score: 0 = max, 1 = sum of the top two", (0, 1)),
        Attr("renorm", "int", 0, "1 = renormalise the softmax weights (norm_type 0)", (0, 1)),
        Attr("norm_type", "int", 0, "0 = softmax, 1 = sigmoid, 2 = sqrt(softplus)", (0, 1, 2)),
        Attr("out_flag", "int", 0, "1 = the NPU writes out (here it is always written)", (0, 1)),
        Attr("routed_scaling_factor", "float", 1.0, "factor of y"),
        Attr("eps", "float", 1e-20, "added to the sum of the weights when renormalising"),
    ],
    infer=_infer,
    kernel=moe_gating_top_k,
    npu_limits=_npu_limits,
    example=_EXAMPLE,
)

DEFINITIONS = [MOE_GATING_TOP_K]
