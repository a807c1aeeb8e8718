"""MoeTokenPermuteGrad: the gradient of MoeTokenPermute with respect to tokens (SPEC 1.11 (d)).

``sorted_indices`` is the forward's output, src slot ``p = t*K + j`` -> dst row d of the
permuted tokens (F = T*K slots; M = rows of the gradient). Token t was copied to the rows of
its K slots, so its gradient sums theirs::

    input_grad[t] = sum over j = 0..K-1 with d = sorted_indices[t*K + j] < M of permuted_output_grad[d]

A slot whose row is ``>= M`` was cut off by ``num_out_tokens`` and adds nothing (SPEC 1.3's
active mode: on ascend950 torch_npu runs MoeInitRoutingV2Grad with ``active_num = M``). The
terms are added in j order in float32 (float64 for the bare kernel's float64), starting from
+0.0, and rounded once to nearest even: the same bits on every run.
"""

from __future__ import annotations

import numpy as np

from . import fused
from .dtypes import FLOATS
from .errors import MoeOpError
from .opdef import Attr, Dim, Example, Input, OpDef, Output, Signature


def moe_token_permute_grad(permuted_output_grad, sorted_indices, *, num_topk, padded_mode=0):
    """Sum each token's K row gradients.

    Args:
        permuted_output_grad: ``[M, H]`` float32/float16/bfloat16.
        sorted_indices: ``[T*K]`` int32 from the forward: src slot -> dst row (>= 0).
        num_topk: K > 0.
        padded_mode: 0 (1 is refused by the static rules).
    Returns:
        ``(input_grad,)``: ``[T, H]`` in the gradient's dtype.
    """
    negative = np.flatnonzero(sorted_indices < 0)
    if len(negative):
        p = int(negative[0])
        raise MoeOpError(f"sorted_indices must be >= 0 (rows of the permute), got {sorted_indices[p]} at slot {p}")
    rows = len(permuted_output_grad)
    source = np.where(sorted_indices < rows, sorted_indices, -1)  # -1: cut off, skipped
    n_tokens = len(sorted_indices) // num_topk
    segment_start = np.arange(n_tokens + 1) * num_topk  # token t's terms: t*K .. t*K + K - 1
    return (fused.segment_sums(permuted_output_grad, source, segment_start),)


def _infer(sig: Signature) -> None:
    grad = sig.input("permuted_output_grad")
    top_k, slots = sig.attr("num_topk"), sig.dim("sorted_indices", 0)
    sig.require(top_k > 0, f"num_topk must be > 0, got {top_k}")
    sig.require(
        sig.attr("padded_mode") == 0,
        "padded_mode=1 is not supported (the NPU rejects it: aclnnMoeTokenPermuteGrad 561002)",
    )
    tokens: Dim = sig.quotient(slots, top_k, "len(sorted_indices) must be a multiple of num_topk (T = len / K)")
    if tokens is None and top_k == 1:
        tokens = slots  # a symbolic length survives division by 1
    sig.output("input_grad", grad.dtype, (tokens, sig.dim("permuted_output_grad", 1)))


#: the gradient of 6 permuted rows summed back onto their 3 tokens
_EXAMPLE = Example(
    inputs={
        "permuted_output_grad": np.arange(12, dtype=np.float32).reshape(6, 2),
        "sorted_indices": np.array([0, 3, 2, 1, 4, 5], np.int32),
    },
    attrs={"num_topk": 2},
)


MOE_TOKEN_PERMUTE_GRAD = OpDef(
    "MoeTokenPermuteGrad",
    __doc__,
    inputs=[
        Input("permuted_output_grad", FLOATS, "[M, H] gradient of the permuted tokens", (2,)),
        Input("sorted_indices", ("int32",), "[T*K] the forward's src slot -> dst row", (1,)),
    ],
    outputs=[Output("input_grad", FLOATS, "[T, H] gradient of tokens, T = len(sorted_indices) / num_topk")],
    attrs=[
        Attr("num_topk", "int", None, "K, slots per token (> 0)", required=True),
        Attr("padded_mode", "int", 0, "0 only (the NPU rejects 1)", (0, 1)),
    ],
    infer=_infer,
    kernel=moe_token_permute_grad,
    example=_EXAMPLE,
)

DEFINITIONS = [MOE_TOKEN_PERMUTE_GRAD]
