"""The routing-map family's validation: every rule raises MoeOpError with its CANN code, the
op, the node and the offending values. The rules are checked on the bare OpDef call (fast,
in process); a selection also through the session, in a subprocess that must exit normally
(an exception escaping a PyOp would abort the process)."""

from __future__ import annotations

import numpy as np
import pytest

import moe_onnx
from tests.support import assert_refused, run_node

PERMUTE, PERMUTE_GRAD = "MoeTokenPermuteWithRoutingMap", "MoeTokenPermuteWithRoutingMapGrad"
UNPERMUTE, UNPERMUTE_GRAD = "MoeTokenUnpermuteWithRoutingMap", "MoeTokenUnpermuteWithRoutingMapGrad"

# T = 4, E = 3, K = 2, H = 2; not padded N = 8, padded (C = 2) N = 6
ROUTING = np.array([[1, 0, 1], [0, 1, 1], [1, 1, 0], [1, 0, 1]], np.int8)
TOKENS = np.ones((4, 2), np.float32)
PROBS = np.ones((4, 3), np.float32)
SORTED = np.array([0, 5, 3, 6, 1, 4, 2, 7], np.int32)
ROWS = np.ones((8, 2), np.float32)
TOKEN_ID = np.arange(8, dtype=np.int32) // 2


def call(op_type, *inputs, **attrs):
    return moe_onnx.OPS[op_type](*inputs, node_name="n", **attrs)


CASES = [  # (id, op, inputs, attrs, code, fragments)
    (
        "int8 map not 0/1",
        PERMUTE,
        (TOKENS, np.where(ROUTING == 1, 2, 0).astype(np.int8)),
        {"num_out_tokens": 8},
        561002,
        ["only 0 and 1, got 2 at [0, 0]"],
    ),
    (
        "row without K ones",
        PERMUTE,
        (TOKENS, np.array([[1, 0, 1], [1, 1, 1], [1, 0, 0], [1, 0, 1]], np.int8)),
        {"num_out_tokens": 8},
        561002,
        ["exactly K = 2 ones; row 1 holds 3"],
    ),
    (
        "num_out_tokens not a multiple of T",
        PERMUTE,
        (TOKENS, ROUTING),
        {"num_out_tokens": 9},
        561002,
        ["multiple of T", "got 9 rows for 4"],
    ),
    (
        "num_out_tokens not a multiple of E",
        PERMUTE,
        (TOKENS, ROUTING),
        {"num_out_tokens": 7, "drop_and_pad": 1},
        561002,
        ["multiple of E", "got 7 rows for 3"],
    ),
    ("K above E", PERMUTE, (TOKENS, ROUTING), {"num_out_tokens": 16}, 561002, ["K = num_out_tokens / T = 4"]),
    (
        "capacity above T",
        PERMUTE,
        (TOKENS, ROUTING),
        {"num_out_tokens": 15, "drop_and_pad": 1},
        561002,
        ["capacity C = 5 must not exceed T = 4"],
    ),
    ("num_out_tokens missing", PERMUTE, (TOKENS, ROUTING), {}, 161001, ["'num_out_tokens' is required"]),
    (
        "float16 probs with bfloat16 tokens",
        PERMUTE,
        (TOKENS.astype(moe_onnx.custom_ops.dtypes.numpy_dtype("bfloat16")), ROUTING, PROBS.astype(np.float16)),
        {"num_out_tokens": 8},
        161002,
        ["probs must have the dtype of tokens (bfloat16)", "got float16"],
    ),
    (
        "float32 probs with float16 tokens",
        PERMUTE,
        (TOKENS.astype(np.float16), ROUTING, PROBS),
        {"num_out_tokens": 8},
        161002,
        ["or be float32 when tokens is bfloat16; got float32"],
    ),
    (
        "probs shape",
        PERMUTE,
        (TOKENS, ROUTING, np.ones((4, 2), np.float32)),
        {"num_out_tokens": 8},
        561002,
        ["probs must be [T, E]"],
    ),
    (
        "drop_and_pad 2",
        PERMUTE,
        (TOKENS, ROUTING),
        {"num_out_tokens": 8, "drop_and_pad": 2},
        561002,
        ["must be one of [0, 1]"],
    ),
    (
        "grad: probs grad without routing_map",
        PERMUTE_GRAD,
        (ROWS, np.ones(8, np.float32), SORTED),
        {"tokens_num": 4, "experts_num": 3},
        561002,
        ["input routing_map is required"],
    ),
    ("grad: T unknown", PERMUTE_GRAD, (ROWS, None, SORTED), {}, 161001, ["tokens_num or input routing_map"]),
    (
        "grad: tokens_num disagrees with routing_map",
        PERMUTE_GRAD,
        (ROWS, None, SORTED, ROUTING),
        {"tokens_num": 5},
        561002,
        ["routing_map dim 0 must equal tokens_num (got 4 and 5)"],
    ),
    (
        "grad: sorted_indices out of range",
        PERMUTE_GRAD,
        (ROWS, None, np.where(SORTED == 6, 8, SORTED), ROUTING),
        {},
        561002,
        ["sorted_indices values must be in [0, 8), got 8 at position 3"],
    ),
    (
        "grad: padded token out of range",
        PERMUTE_GRAD,
        (np.ones((6, 2), np.float32), None, np.array([0, 2, 1, 4, 0, 1], np.int32), ROUTING),
        {"drop_and_pad": 1},
        561002,
        ["a negative (empty slot) or in [0, 4), got 4 at position 3"],
    ),
    (
        "unpermute: probs without routing_map",
        UNPERMUTE,
        (ROWS, SORTED, None, PROBS),
        {"restore_shape": [4, 2]},
        561002,
        ["input routing_map is required with probs"],
    ),
    (
        "unpermute: a row twice",
        UNPERMUTE,
        (ROWS, np.where(SORTED == 7, 0, SORTED)),
        {"restore_shape": [4, 2]},
        561002,
        ["must not repeat a row: row 0 appears 2 times"],
    ),
    (
        "unpermute: restore_shape H",
        UNPERMUTE,
        (ROWS, SORTED),
        {"restore_shape": [4, 3]},
        561002,
        ["restore_shape[1] must equal H"],
    ),
    ("unpermute: T unknown", UNPERMUTE, (ROWS, SORTED), {}, 161001, ["restore_shape or input routing_map"]),
    (
        "unpermute: N not a multiple of T",
        UNPERMUTE,
        (np.ones((7, 2), np.float32), SORTED[:7]),
        {"restore_shape": [4, 2]},
        561002,
        ["multiple of T (K = N / T): got 7 rows for 4"],
    ),
    (
        "unpermute grad: probs without permuted_tokens",
        UNPERMUTE_GRAD,
        (TOKENS, SORTED, TOKEN_ID, ROUTING, None, PROBS),
        {},
        561002,
        ["input permuted_tokens is required with probs"],
    ),
    (
        "unpermute grad: probs without routing_map",
        UNPERMUTE_GRAD,
        (TOKENS, SORTED, TOKEN_ID, None, ROWS, PROBS),
        {},
        561002,
        ["input routing_map is required with probs"],
    ),
    (
        "unpermute grad: N not a multiple of T",
        UNPERMUTE_GRAD,
        (TOKENS[:3], SORTED, TOKEN_ID),
        {},
        561002,
        ["multiple of T = unpermuted_tokens_grad dim 0", "(K = N / T): got 8 rows for 3"],
    ),
    (
        "unpermute grad: N not a multiple of E",
        UNPERMUTE_GRAD,
        (TOKENS, SORTED[:7], TOKEN_ID[:7], ROUTING, ROWS[:7], PROBS),
        {"drop_and_pad": 1},
        561002,
        ["multiple of E = routing_map dim 1", "(C = N / E): got 7 rows for 3"],
    ),
    (
        "unpermute grad: token id out of range (padded; not padded it is not read, SPEC 1.6)",
        UNPERMUTE_GRAD,
        (TOKENS, SORTED, np.where(TOKEN_ID == 3, 4, TOKEN_ID)),
        {"drop_and_pad": 1},
        561002,
        ["permute_token_id values must be a negative (empty slot) or in [0, 4), got 4 at position 6"],
    ),
    (
        "unpermute grad: out_index out of range",  # (not padded, a negative one is an unused slot)
        UNPERMUTE_GRAD,
        (TOKENS, np.where(SORTED == 7, 9, SORTED), TOKEN_ID),
        {},
        561002,
        ["out_index values must be in [0, 8), got 9 at position 7"],
    ),
    (
        "unpermute grad: negative out_index of a filled pair, padded",
        UNPERMUTE_GRAD,
        (TOKENS, np.where(SORTED == 7, -2, SORTED), TOKEN_ID),
        {"drop_and_pad": 1},
        561002,
        ["out_index values must be in [0, 8), got -2 at position 7"],
    ),
    (
        "unpermute grad: out_index repeats",
        UNPERMUTE_GRAD,
        (TOKENS, np.where(SORTED == 7, 1, SORTED), TOKEN_ID),
        {},
        561002,
        ["out_index must not repeat a row: row 1 appears 2 times"],
    ),
    (
        "unpermute grad: float16 probs with float32 grad",
        UNPERMUTE_GRAD,
        (TOKENS, SORTED, TOKEN_ID, ROUTING, ROWS, PROBS.astype(np.float16)),
        {},
        161002,
        ["got float16"],
    ),
    (
        "unpermute grad: permuted_tokens dtype",
        UNPERMUTE_GRAD,
        (TOKENS, SORTED, TOKEN_ID, ROUTING, ROWS.astype(np.float16), PROBS),
        {},
        161002,
        ["permuted_tokens must have the dtype of unpermuted_tokens_grad (float32), got float16"],
    ),
    (
        "unpermute grad: restore_shape",
        UNPERMUTE_GRAD,
        (TOKENS, SORTED, TOKEN_ID),
        {"restore_shape": [5, 2]},
        561002,
        ["restore_shape[0] must equal T"],
    ),
    (
        "unpermute grad: int8 map",
        UNPERMUTE_GRAD,
        (TOKENS, SORTED, TOKEN_ID, np.where(ROUTING == 1, -1, 0).astype(np.int8), ROWS, PROBS),
        {},
        561002,
        ["only 0 and 1, got -1 at [0, 0]"],
    ),
    (
        "unpermute grad: float64",
        UNPERMUTE_GRAD,
        (TOKENS.astype(np.float64), SORTED, TOKEN_ID),
        {},
        161002,
        ["'unpermuted_tokens_grad' has dtype float64"],
    ),
]


@pytest.mark.parametrize("op_type, inputs, attrs, code, fragments", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_rule(op_type, inputs, attrs, code, fragments):
    with pytest.raises(moe_onnx.MoeOpError) as info:
        call(op_type, *inputs, **attrs)
    err = info.value
    assert (err.code, err.op_type, err.node_name) == (code, op_type, "n"), str(err)
    for fragment in fragments:
        assert fragment in str(err)


def test_optional_output_without_its_input():
    with pytest.raises(moe_onnx.MoeOpError, match="output permuted_probs needs input probs"):
        moe_onnx.OPS[PERMUTE](
            TOKENS, ROUTING, num_out_tokens=8, wanted={"permuted_tokens", "sorted_indices", "permuted_probs"}
        )


# --- through the session, in a subprocess ---------------------------------------------------

routing = np.array([[1, 0, 1], [0, 1, 1], [1, 1, 0], [1, 0, 1]], np.int8)
tokens = np.ones((4, 2), np.float32)
probs = np.ones((4, 3), np.float32)
sorted_indices = np.array([0, 5, 3, 6, 1, 4, 2, 7], np.int32)
token_id = np.arange(8, dtype=np.int32) // 2
rows = np.ones((8, 2), np.float32)


def permute(routing=routing, **attrs):
    return run_node(
        "MoeTokenPermuteWithRoutingMap",
        {"tokens": tokens, "routing_map": routing, "probs": probs},
        {"num_out_tokens": 8, **attrs},
    )


def unpermute_grad(out_index=sorted_indices, token_id=token_id, routing=routing, permuted=rows, probs=probs, **attrs):
    return run_node(
        "MoeTokenUnpermuteWithRoutingMapGrad",
        {
            "unpermuted_tokens_grad": tokens,
            "out_index": out_index,
            "permute_token_id": token_id,
            "routing_map": routing,
            "permuted_tokens": permuted,
            "probs": probs,
        },
        attrs,
    )


def test_session_int8_map_not_binary():
    assert_refused(
        lambda: permute(routing=routing * 3),
        561002,
        "MoeTokenPermuteWithRoutingMap node 'node'",
        "only 0 and 1, got 3 at [0, 0]",
    )


def test_session_row_without_k_ones():
    assert_refused(
        lambda: permute(routing=np.eye(4, 3, dtype=np.int8) + routing * 0), 561002, "exactly K = 2 ones; row 0 holds 1"
    )


def test_session_capacity_above_tokens():
    assert_refused(lambda: permute(num_out_tokens=15, drop_and_pad=1), 561002, "capacity C = 5 must not exceed T = 4")


def test_session_probs_without_permuted_tokens():
    assert_refused(
        lambda: unpermute_grad(permuted=None),
        561002,
        "MoeTokenUnpermuteWithRoutingMapGrad node 'node",
        "input permuted_tokens is required",
    )


def test_session_token_id_out_of_range():
    """Padded, permute_token_id names the tokens; not padded it is not read (SPEC 1.6)."""
    assert_refused(
        lambda: unpermute_grad(token_id=token_id * 2, routing=None, permuted=None, probs=None, drop_and_pad=1),
        561002,
        "permute_token_id values must be a negative (empty slot) or in [0, 4), got 4",
    )
    for got, want in zip(unpermute_grad(token_id=token_id * 2), unpermute_grad()):
        assert np.array_equal(got, want)


def test_session_k_does_not_divide():
    assert_refused(
        lambda: unpermute_grad(out_index=sorted_indices[:6], token_id=token_id[:6], permuted=rows[:6]),
        561002,
        "(K = N / T): got 6 rows for 4",
    )


def test_session_mixed_dtypes_the_seeds_do_not_allow():
    assert_refused(
        lambda: unpermute_grad(probs=probs.astype(np.float16)),
        161002,
        "probs must have the dtype of unpermuted_tokens_grad (float32)",
    )
