"""MoeComputeExpertTokens: where each expert's rows end in an expert-sorted list (SPEC 1.16).

torch_npu's ``npu_moe_compute_expert_tokens(sorted_expert_for_source_row, num_expert)``.
``sorted_experts [N]`` is a non-decreasing list of expert ids (MoeInitRouting's
``expanded_expert_idx``); the output is, per expert e, the number of entries ``<= e``::

    total_rows_before_expert[e] = searchsorted(sorted_experts, e, side="right")

That is the **inclusive** cumsum of the per-expert counts, the exclusive end row of expert e
(the doc's "last row position" is last index + 1; ops-transformer's golden, ``gen_data.py``,
is "last index <= e, plus 1"), not a count despite the GE name. It is what GroupedMatmul
takes with ``group_list_type 0``, as omni-infer and cann-recipes-infer feed it. Ids
``>= num_experts`` are accepted and counted by no expert: omni-infer passes the sentinel E
for non-local experts, which the doc forbids; ``targets.check`` flags it.
"""

from __future__ import annotations

import numpy as np

from . import fused
from .errors import MoeOpError
from .opdef import Attr, Example, Input, OpDef, Output, Signature
from .targets import Target, known_dim

#: the tiling's E_BOUND_NUM_UP_LIMIT and BSK_BOUND_NUM_UP_LIMIT (moe_compute_expert_tokens_tiling.cpp)
MAX_EXPERTS = 2048
MAX_ROWS = 2**24


def moe_compute_expert_tokens(sorted_experts, *, num_experts):
    """Exclusive end row of each expert in a sorted expert list.

    Args:
        sorted_experts: ``[N]`` int32, non-decreasing, >= 0 (ids >= num_experts: not counted).
        num_experts: E > 0.
    Returns:
        ``(total_rows_before_expert,)``: ``[E]`` int32, non-decreasing, the last <= N.
    """
    ends = fused.expert_ends(sorted_experts, num_experts)
    if ends is not None:
        return (ends,)
    first = int(sorted_experts[0])
    if first < 0:  # non-decreasing (below): the first is the least
        raise MoeOpError(f"sorted_experts must be >= 0 (expert ids), got {first} at position 0")
    i = int(np.argmax(sorted_experts[1:] < sorted_experts[:-1]))
    raise MoeOpError(
        f"sorted_experts must be non-decreasing (the op binary-searches it), got {sorted_experts[i]} at "
        f"position {i} then {sorted_experts[i + 1]}"
    )


def _infer(sig: Signature) -> None:
    experts = sig.attr("num_experts")
    sig.require(experts > 0, f"num_experts must be > 0, got {experts}")
    sig.allocates(experts * 12, f"the per-expert ends of num_experts = {experts} experts")
    sig.output("total_rows_before_expert", "int32", (experts,))


def _npu_limits(sig: Signature, target: Target) -> list[str]:
    found = []
    experts, rows = sig.attr("num_experts"), known_dim(sig, "sorted_experts", 0)
    if experts > MAX_EXPERTS:
        found.append(f"num_experts = {experts} exceeds {MAX_EXPERTS}")
    if rows is not None and rows > MAX_ROWS:
        found.append(f"len(sorted_experts) = {rows} exceeds 2^24 = {MAX_ROWS}")
    ids = sig.value("sorted_experts")
    if ids is not None and ids.size and int(ids.max()) >= experts:
        beyond = int(np.count_nonzero(ids >= experts))
        found.append(
            f"{beyond} ids >= num_experts = {experts} (largest {int(ids.max())}): the doc forbids them; the CPU "
            "golden counts them for no expert (omni-infer's sentinel E relies on this)"
        )
    return found


#: the end row of each of 4 experts in a sorted list of expert ids
_EXAMPLE = Example(
    inputs={
        "sorted_experts": np.array([0, 0, 1, 2, 2, 3], np.int32),
    },
    attrs={"num_experts": 4},
)


MOE_COMPUTE_EXPERT_TOKENS = OpDef(
    "MoeComputeExpertTokens",
    __doc__,
    inputs=[Input("sorted_experts", ("int32",), "[N] expert ids, non-decreasing, >= 0", (1,))],
    outputs=[
        Output("total_rows_before_expert", ("int32",), "[E] rows of experts 0..e: the inclusive cumsum of counts")
    ],
    attrs=[Attr("num_experts", "int", None, "E > 0 (torch_npu: num_expert)", required=True)],
    infer=_infer,
    kernel=moe_compute_expert_tokens,
    npu_limits=_npu_limits,
    example=_EXAMPLE,
)

DEFINITIONS = [MOE_COMPUTE_EXPERT_TOKENS]
