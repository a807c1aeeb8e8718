"""Random malformed calls of every op, through the bare kernel and every executor.

A program, run in a subprocess by ``tests/test_fuzz.py`` (an abort must not end the test
run, and must show as the program's exit status):

    python tests/malformed.py --examples 40 [--seed 0] [--op MoeReRoutingV2] [--executor lowered]

Each example starts from a valid call of one op (random small sizes) and breaks it in one
or two ways: a dim, a dtype, a rank, a value (negative, huge, out of range, 2**62), an
absent input, an attribute of another value or another kind. Then the same call goes
through ``OpDef.__call__`` and through ``moe_onnx.InferenceSession`` with every executor,
and the rules are:

* any refusal is a ``MoeOpError`` (at session creation or at run);
* the bare call and every executor agree: all refuse, or all return the same bits (the
  lowered executor: the same bits but for float sums, within float32 accumulation error).

Prints one line per broken rule and ends with ``SUMMARY {json}``.
"""

from __future__ import annotations

import argparse
import json
import sys

import ml_dtypes
import numpy as np
import onnx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from onnx import helper

import moe_onnx
from moe_onnx.custom_ops import ALL_OPS, dtypes
from moe_onnx.runtime.session import EXECUTORS as ALL_EXECUTORS
from moe_onnx.runtime.session import KERNEL_EXECUTORS

# collectives (AllToAll, AllGather) need a communicator: their refusals are tested on ranks
OPS = [name for (domain, name), op in ALL_OPS.items() if domain == "cann.moe" and not op.needs]
BF16 = np.dtype(ml_dtypes.bfloat16)
HUGE = 2**62


def _routing(rng, tokens: int, experts: int, top_k: int) -> np.ndarray:
    routing = np.zeros((tokens, experts), bool)
    for t in range(tokens):
        routing[t, rng.permutation(experts)[:top_k]] = True
    return routing


def valid_call(op: str, rng) -> tuple[dict, dict]:
    """A call ``op`` accepts: inputs by declared name (None = absent) and attributes."""
    tokens, hidden, experts = int(rng.integers(0, 5)), int(rng.integers(1, 5)), int(rng.integers(1, 5))
    top_k = int(rng.integers(1, experts + 1))
    floats = [np.float32, np.float16, BF16][int(rng.integers(0, 3))]
    if op in ("MoeReRoutingV2", "MoeReRouting"):
        counts = rng.integers(0, 3, (int(rng.integers(1, 4)), experts)).astype(
            np.int64 if rng.random() < 0.5 else np.int32
        )
        rows = int(counts.sum())
        inputs = {"tokens": rng.standard_normal((rows, hidden)).astype(floats), "expert_token_num_per_rank": counts}
        if op == "MoeReRoutingV2":
            inputs["per_token_scales"] = None
            inputs["expert_topk_weight"] = rng.random((rows, 1)).astype(np.float32) if rng.random() < 0.5 else None
        return inputs, {"idx_type": int(rng.integers(0, 2)), "expert_token_num_type": int(rng.integers(0, 2))}
    if op == "MoeInitRoutingV2":
        padded = int(rng.integers(0, 2))
        tokens = max(tokens, padded)  # drop/pad needs 0 < C <= T
        x = rng.standard_normal((tokens, hidden)).astype(floats)
        expert_idx = rng.integers(0, experts, (tokens, top_k)).astype(np.int32)
        attrs = {"expert_num": experts, "drop_pad_mode": padded, "expert_tokens_count_or_cumsum_flag": 2}
        if padded:
            attrs["expert_capacity"] = int(rng.integers(1, tokens + 1))
        return {"x": x, "expert_idx": expert_idx}, attrs
    if op == "MoeInitRoutingV3":
        padded = int(rng.integers(0, 2))
        tokens = max(tokens, padded)
        dtype = [np.float32, np.float16, BF16, np.int8, np.uint8][int(rng.integers(0, 5))]
        x = rng.standard_normal((tokens, hidden)).astype(np.float32).astype(dtype)
        expert_idx = rng.integers(0 if padded else -1, experts, (tokens, top_k)).astype(np.int32)
        scale = rng.standard_normal(tokens).astype(np.float32) if rng.random() < 0.5 else None
        attrs = {"expert_num": experts, "drop_pad_mode": padded, "expert_tokens_num_flag": int(rng.integers(0, 2))}
        if padded:
            attrs.update(expert_capacity=int(rng.integers(1, tokens + 1)), expert_tokens_num_type=1)
        else:
            start = int(rng.integers(0, experts))
            attrs.update(
                active_expert_range=[start, int(rng.integers(start + 1, experts + 1))],
                row_idx_type=int(rng.integers(0, 2)),
                expert_tokens_num_type=int(rng.integers(0, 3)),
                active_num=int(rng.integers(-1, tokens * top_k + 2)),
            )
        return {"x": x, "expert_idx": expert_idx, "scale": scale, "offset": None}, attrs
    if op == "MoeInitRoutingV2Grad":
        rows = tokens * top_k
        return (
            {
                "grad_expanded_x": rng.standard_normal((rows, hidden)).astype(floats),
                "expanded_row_idx": rng.permutation(rows).astype(np.int32),
            },
            {"top_k": top_k},
        )
    if op in DISPATCH:
        return _dispatch_call(op, rng, tokens, hidden, experts, top_k, floats)
    if op == "MoeGatingTopKSoftmax":
        lead = (tokens,) if rng.random() < 0.5 else (2, tokens)
        finished = rng.random(lead) < 0.3 if rng.random() < 0.5 else None
        return {"x": rng.standard_normal(lead + (experts,)).astype(floats), "finished": finished}, {"k": top_k}
    if op == "MoeGatingTopK":
        mode, groups = int(rng.integers(0, 2)), int(rng.integers(1, 3))
        experts = groups * int(rng.integers(mode + 1, 4))
        k_group = int(rng.integers(1, groups + 1))
        k = int(rng.integers(1, k_group * experts // groups + 1))
        inputs = {
            "x": rng.standard_normal((tokens, experts)).astype(floats),
            "bias": rng.standard_normal(experts).astype(floats) if rng.random() < 0.5 else None,
            "input_ids": None,
            "tid2eid": None,
        }
        if rng.random() < 0.4:  # hash mode
            inputs["input_ids"] = rng.integers(0, 3, tokens).astype(np.int64 if rng.random() < 0.5 else np.int32)
            inputs["tid2eid"] = rng.integers(0, experts, (3, k)).astype(np.int32)
        attrs = {
            "k": k,
            "k_group": k_group,
            "group_count": groups,
            "group_select_mode": mode,
            "norm_type": int(rng.integers(0, 3)),
            "renorm": int(rng.integers(0, 2)),
            "routed_scaling_factor": 2.5,
        }
        return inputs, attrs
    if op == "MoeGatingTopKBackward":
        x_norm = rng.random((tokens, experts)).astype(np.float32)
        expert_idx = rng.integers(0, experts, (tokens, top_k)).astype(np.int32)
        grad_y = rng.standard_normal((tokens, top_k)).astype(floats)
        return {"x_norm": x_norm, "grad_y": grad_y, "expert_idx": expert_idx}, {"routed_scaling_factor": 1.5}
    if op in LAYER_OPS:
        return _layer_call(op, rng, tokens, hidden, experts, top_k, floats)
    routing = _routing(rng, tokens, experts, top_k)
    map_dtype = np.int8 if rng.random() < 0.5 else np.bool_
    tokens_data = rng.standard_normal((tokens, hidden)).astype(floats)
    probs = (rng.random((tokens, experts)) * routing).astype(floats) if rng.random() < 0.5 else None
    permuted, sorted_indices, permuted_probs = moe_onnx.OPS["MoeTokenPermuteWithRoutingMap"](
        tokens_data, routing, probs, num_out_tokens=tokens * top_k
    )
    if op == "MoeTokenPermuteWithRoutingMap":
        attrs = {"num_out_tokens": tokens * top_k}
        return {"tokens": tokens_data, "routing_map": routing.astype(map_dtype), "probs": probs}, attrs
    if op == "MoeTokenPermuteWithRoutingMapGrad":
        inputs = {
            "permuted_tokens_grad": rng.standard_normal(permuted.shape).astype(floats),
            "permuted_probs_grad": None
            if permuted_probs is None
            else rng.standard_normal(len(permuted)).astype(floats),
            "sorted_indices": sorted_indices,
            "routing_map": routing.astype(map_dtype),
        }
        return inputs, {}
    if op == "MoeTokenUnpermuteWithRoutingMap":
        inputs = {
            "permuted_tokens": permuted,
            "sorted_indices": sorted_indices,
            "routing_map": routing.astype(map_dtype),
            "probs": probs,
        }
        return inputs, {"restore_shape": [tokens, hidden]}
    if op == "MoeTokenUnpermuteWithRoutingMapGrad":
        _, out_index, token_id, _ = moe_onnx.OPS["MoeTokenUnpermuteWithRoutingMap"](
            permuted, sorted_indices, routing, None, restore_shape=[tokens, hidden]
        )
        inputs = {
            "unpermuted_tokens_grad": rng.standard_normal((tokens, hidden)).astype(floats),
            "out_index": out_index,
            "permute_token_id": token_id,
            "routing_map": routing.astype(map_dtype),
            "permuted_tokens": permuted if probs is not None else None,
            "probs": probs,
        }
        return inputs, {}
    raise ValueError(op)


DISPATCH = (
    "MoeTokenPermute",
    "MoeTokenPermuteGrad",
    "MoeTokenUnpermute",
    "MoeTokenUnpermuteGrad",
    "MoeInitRouting",
    "MoeComputeExpertTokens",
)


def _dispatch_call(op: str, rng, tokens: int, hidden: int, experts: int, top_k: int, floats) -> tuple[dict, dict]:
    """A valid call of the ops routed by expert indices (SPEC 1.11, 1.12, 1.15, 1.16)."""
    indices = rng.integers(0, experts, (tokens, top_k)).astype(np.int64 if rng.random() < 0.5 else np.int32)
    tokens_data = rng.standard_normal((tokens, hidden)).astype(floats)
    n = int(rng.choice([0, -1, tokens * top_k + 1]))
    n = max(n, -tokens * top_k)
    permuted, sorted_indices = moe_onnx.OPS["MoeTokenPermute"](tokens_data, indices, num_out_tokens=n)
    probs = rng.random((tokens, top_k)).astype(floats) if rng.random() < 0.5 else None
    if op == "MoeTokenPermute":
        return {"tokens": tokens_data, "indices": indices}, {"num_out_tokens": n}
    if op == "MoeTokenPermuteGrad":
        grad = rng.standard_normal(permuted.shape).astype(floats)
        return {"permuted_output_grad": grad, "sorted_indices": sorted_indices}, {"num_topk": top_k}
    if probs is None:  # without probs K = 1: every slot is its own row
        permuted, sorted_indices = moe_onnx.OPS["MoeTokenPermute"](tokens_data, indices[:, :1], num_out_tokens=n)
    if op == "MoeTokenUnpermute":
        return {"permuted_tokens": permuted, "sorted_indices": sorted_indices, "probs": probs}, {}
    if op == "MoeTokenUnpermuteGrad":
        inputs = {
            "permuted_tokens": permuted if probs is not None or rng.random() < 0.5 else None,
            "unpermuted_tokens_grad": rng.standard_normal((tokens, hidden)).astype(floats),
            "sorted_indices": sorted_indices,
            "probs": probs,
        }
        return inputs, {} if inputs["permuted_tokens"] is not None else {"permuted_tokens_num": len(permuted)}
    row_idx = np.arange(tokens * top_k, dtype=np.int32).reshape(top_k, tokens).T.copy()
    expert_idx = indices.astype(np.int32)
    if op == "MoeInitRouting":
        return {"x": tokens_data, "row_idx": row_idx, "expert_idx": expert_idx}, {"active_num": tokens}
    if op == "MoeComputeExpertTokens":
        return {"sorted_experts": np.sort(expert_idx.reshape(-1))}, {"num_experts": experts}
    raise ValueError(op)


#: the expert-compute and combine ops (SPEC-layer 1.8-1.10)
LAYER_OPS = ("MoeFinalizeRoutingV2", "MoeFinalizeRoutingV2Grad", "GroupedMatmul", "SwiGlu", "SwiGluGrad")


def _layer_call(op: str, rng, tokens: int, hidden: int, experts: int, top_k: int, floats) -> tuple[dict, dict]:
    def maybe(value):
        return value if rng.random() < 0.5 else None

    slots = tokens * top_k
    if op in ("MoeFinalizeRoutingV2", "MoeFinalizeRoutingV2Grad"):
        padded = bool(rng.random() < 0.5)
        capacity = int(rng.integers(1, 4))
        rows = experts * capacity if padded else slots
        index = rng.permutation(max(rows, slots))[:slots] if padded else rng.permutation(slots)
        index = np.where(index < rows, index, -1).astype(np.int32)
        x_rows = rng.standard_normal((experts, capacity, hidden) if padded else (rows, hidden)).astype(floats)
        scales = maybe(rng.random((tokens, top_k)).astype(np.float32 if floats == BF16 else floats))
        expert_idx = rng.integers(0, experts, (tokens, top_k)).astype(np.int32)
        bias = maybe(rng.standard_normal((experts, hidden)).astype(floats))
        if op == "MoeFinalizeRoutingV2":
            x1 = maybe(rng.standard_normal((tokens, hidden)).astype(floats))
            x2 = None if x1 is None else maybe(rng.standard_normal((tokens, hidden)).astype(floats))
            inputs = {"expanded_x": x_rows, "expanded_row_idx": index, "x1": x1, "x2": x2, "bias": bias}
            inputs.update(scales=scales, expert_idx=expert_idx if bias is not None else maybe(expert_idx))
            mode = int(rng.integers(0, 2)) * 2 + int(padded)
            if mode in (0, 1):  # column-arranged slots j*R + i
                inputs["expanded_row_idx"] = np.ascontiguousarray(index.reshape(tokens, top_k).T).reshape(-1)
            return inputs, {"drop_pad_mode": mode, "k": top_k}
        inputs = {
            "grad_y": rng.standard_normal((tokens, hidden)).astype(floats),
            "expanded_row_idx": index,
            "expanded_x": x_rows if scales is not None else maybe(x_rows),
            "scales": scales,
            "expert_idx": expert_idx if bias is not None else None,
            "bias": bias,
        }
        if padded:
            return inputs, {"drop_pad_mode": 1, "expert_num": experts, "expert_capacity": capacity}
        return inputs, {}
    if op == "GroupedMatmul":
        group_type = int(rng.choice([0, 2, -1]))
        inner, columns = int(rng.integers(1, 4)), int(rng.integers(1, 4))
        counts = rng.multinomial(tokens, np.ones(experts) / experts)
        cumsum = rng.random() < 0.5
        group_list = (np.cumsum(counts) if cumsum else counts).astype(np.int64)
        attrs = {"group_type": group_type, "group_list_type": 0 if cumsum else 1}
        if group_type == 0:
            inputs = {
                "x": rng.standard_normal((tokens, inner)).astype(floats),
                "weight": rng.standard_normal((experts, inner, columns)).astype(floats),
                "bias": maybe(
                    rng.standard_normal((experts, columns)).astype(np.float16 if floats == np.float16 else np.float32)
                ),
                "group_list": group_list,
            }
        elif group_type == 2:
            inputs = {
                "x": rng.standard_normal((inner, tokens)).astype(floats),
                "weight": rng.standard_normal((tokens, columns)).astype(floats),
                "bias": None,
                "group_list": group_list,
            }
        else:
            inputs = {
                "x": rng.standard_normal((tokens, inner)).astype(floats),
                "weight": rng.standard_normal((inner, columns)).astype(floats),
                "bias": maybe(rng.standard_normal(columns).astype(np.float16 if floats == np.float16 else np.float32)),
            }
            attrs = {"group_type": -1}
        if rng.random() < 0.5:  # the weight stored transposed
            inputs["weight"] = np.ascontiguousarray(np.swapaxes(inputs["weight"], -1, -2))
            attrs["transpose_weight"] = 1
        return inputs, attrs
    shape = [int(rng.integers(0, 4)) for _ in range(int(rng.integers(1, 4)))]
    dim = int(rng.integers(-len(shape), len(shape)))
    shape[dim] *= 2
    x = rng.standard_normal(shape).astype(floats)
    if op == "SwiGlu":
        return {"x": x}, {"dim": dim}
    shape[dim] //= 2
    return {"y_grad": rng.standard_normal(shape).astype(floats), "x": x}, {"dim": dim}


def _break_array(array: np.ndarray, how: int, rng) -> np.ndarray:
    if how == 0 and array.ndim:  # another size along one axis
        shape = list(array.shape)
        shape[int(rng.integers(0, array.ndim))] = int(rng.choice([0, 1, 3, 7]))
        return np.resize(array, shape) if array.size else np.zeros(shape, array.dtype)
    if how == 1:  # another rank
        return array.reshape(-1) if array.ndim != 1 else array.reshape(-1, 1)
    if how == 2:  # another dtype
        return array.astype(rng.choice([np.float64, np.int64, np.int16, np.float16, np.uint8, np.bool_]))
    if how == 3 and array.size and array.dtype.kind in "iu":  # a value out of any range
        info = np.iinfo(array.dtype)
        out = array.copy()
        out.flat[int(rng.integers(0, array.size))] = rng.choice([info.min, info.max] + ([-1] if info.min < 0 else []))
        return out
    if how == 4 and array.dtype.kind in "iu":  # every value huge (sums wrap around)
        return np.full(array.shape, min(HUGE, np.iinfo(array.dtype).max), array.dtype)
    if how == 5 and array.dtype.kind in "iuf" and array.dtype.itemsize > 1:  # (ml_dtypes have no byte order)
        return array.astype(array.dtype.newbyteorder(">"))
    if how == 6 and array.size and array.dtype.kind == "f":
        out = array.astype(np.float32).copy()
        out.flat[0] = np.nan
        return out.astype(array.dtype)
    return array


def _attr_value(kind: str, rng):
    return {
        0: 0,
        1: -1,
        2: int(rng.integers(2, 9)),
        3: HUGE,
        4: 0.5,  # a float where an int is declared
        5: "x",
        6: [1, 2],
        7: [HUGE, 2],
        8: 2**40,
    }[int(rng.integers(0, 9))]


def broken_call(op: str, seed: int, breaks: int) -> tuple[dict, dict]:
    rng = np.random.default_rng(seed)
    inputs, attrs = valid_call(op, rng)
    definition = moe_onnx.OPS[op]
    for _ in range(breaks):
        target = int(rng.integers(0, len(definition.inputs) + len(definition.attrs)))
        if target < len(definition.inputs):
            name = definition.inputs[target].name
            value = inputs.get(name)
            if value is None or rng.random() < 0.1:  # drop it, or make up one where it was absent
                inputs[name] = None if value is not None else rng.standard_normal((2, 2)).astype(np.float32)
            else:
                inputs[name] = _break_array(value, int(rng.integers(0, 7)), rng)
        else:
            attr = definition.attrs[target - len(definition.inputs)]
            attrs[attr.name] = _attr_value(attr.kind, rng)
    return inputs, attrs


def model_of(op: str, inputs: dict, attrs: dict, symbolic: bool = False) -> onnx.ModelProto:
    """A one-node model typed from the arrays, built without shape inference (so the
    executors, not the builder, see what is wrong); ``symbolic``: every input dim a symbol
    of its own, so that shape rules are met at run time, not when the session is made."""
    names = [name if value is not None else "" for name, value in inputs.items()]
    while names and not names[-1]:
        names.pop()
    graph_inputs = []
    for name, value in inputs.items():
        if value is not None:
            elem = dtypes.onnx_type(dtypes.name_of(value.astype(value.dtype.newbyteorder("="))))
            dims = [f"{name}_{axis}" for axis in range(value.ndim)] if symbolic else list(value.shape)
            graph_inputs.append(helper.make_tensor_value_info(name, elem, dims))
    definition = moe_onnx.OPS[op]
    outputs = [o.name for o in definition.outputs]
    if op == "MoeReRoutingV2" and inputs.get("expert_topk_weight") is None:
        outputs[-1] = ""
    if op == "MoeInitRoutingV2":
        outputs[2] = outputs[2] if attrs.get("expert_tokens_count_or_cumsum_flag") else ""
        outputs[3] = outputs[3] if attrs.get("expert_tokens_before_capacity_flag") else ""
    if op == "MoeInitRoutingV3":
        outputs[2] = outputs[2] if attrs.get("expert_tokens_num_flag") else ""
    if op in (
        "MoeTokenPermuteWithRoutingMap",
        "MoeTokenPermuteWithRoutingMapGrad",
        "MoeTokenUnpermuteWithRoutingMap",
        "MoeTokenUnpermuteWithRoutingMapGrad",
    ):
        outputs[-1] = (
            outputs[-1] if inputs.get("probs") is not None or inputs.get("permuted_probs_grad") is not None else ""
        )
    if op == "MoeTokenUnpermuteGrad" and inputs.get("probs") is None:
        outputs[-1] = ""
    # a Python int given for a float attribute is a number to the bare call: the node gets it
    # as a FLOAT too (an INT attribute there is a type error, tested per op)
    floats = {a.name for a in definition.attrs if a.kind == "float"}
    attrs = {k: float(v) if k in floats and isinstance(v, int) else v for k, v in attrs.items()}
    if op == "MoeFinalizeRoutingV2Grad":
        outputs[-1] = outputs[-1] if inputs.get("scales") is not None else ""
    node = helper.make_node(op, names, outputs, domain="cann.moe", name="fuzzed", **attrs)
    graph = helper.make_graph(
        [node], "fuzz", graph_inputs, [helper.make_value_info(name, onnx.TypeProto()) for name in outputs if name]
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("cann.moe", 1)])


def run_session(op: str, inputs: dict, attrs: dict, executor: str, symbolic: bool = False) -> list[np.ndarray]:
    feeds = {k: v for k, v in inputs.items() if v is not None}
    return moe_onnx.InferenceSession(model_of(op, inputs, attrs, symbolic), executor=executor).run(None, feeds)


def outcome(call) -> tuple[str, object]:
    """("ok", outputs) | ("refused", message) | ("other", "Type: message")."""
    try:
        return "ok", call()
    except moe_onnx.MoeOpError as err:
        return "refused", str(err)
    except Exception as err:  # noqa: BLE001 - the rule under test: refusals are MoeOpError
        return "other", f"{type(err).__name__}: {err}"[:300]


def same_outputs(got: list[np.ndarray], want: list[np.ndarray], *, exact: bool) -> bool:
    """Bit-equal; for an inexact executor, float outputs may differ by float32 accumulation
    error (1e-5 relative for float32, two ulps of a 16-bit float)."""
    if len(got) != len(want):
        return False
    for a, b in zip(got, want):
        a, b = np.asarray(a), np.asarray(b)
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        if a.tobytes() == b.tobytes():
            continue
        if exact or a.dtype.kind not in "fV":  # V: bfloat16 from ml_dtypes
            return False
        tolerance = 1e-5 if a.dtype.itemsize >= 4 else 2**-7
        wide_a, wide_b = a.astype(np.float64), b.astype(np.float64)
        close = np.abs(wide_a - wide_b) <= tolerance * np.maximum(np.abs(wide_b), 1.0)
        if not np.all(close | (wide_a == wide_b) | (np.isnan(wide_a) & np.isnan(wide_b))):
            return False
    return True


def check(
    op: str, seed: int, breaks: int, problems: list[str], executors=tuple(ALL_EXECUTORS), symbolic: bool = False
) -> str:
    try:
        inputs, attrs = broken_call(op, seed, breaks)
    except Exception as err:  # noqa: BLE001 - the generator itself tripped on a valid kernel call
        problems.append(f"{op} seed {seed}: building the call failed: {type(err).__name__}: {err}")
        return "other"
    definition = moe_onnx.OPS[op]
    args = list(inputs.values())
    bare = outcome(lambda: [x for x in definition(*args, node_name="fuzzed", **attrs) if x is not None])
    results = {"bare": bare}
    for executor in executors:
        results[executor] = outcome(lambda executor=executor: run_session(op, inputs, attrs, executor, symbolic))
    where = f"{op} seed {seed} breaks {breaks}"
    for name, (kind, value) in results.items():
        if kind == "other":
            problems.append(f"{where}: {name} raised {value}")
    kinds = {kind for kind, _ in results.values()}
    if kinds == {"ok"}:
        want = bare[1]
        for executor in executors:
            if not same_outputs(results[executor][1], want, exact=executor in KERNEL_EXECUTORS):
                problems.append(f"{where}: {executor} returned other bits than the bare kernel")
    elif "ok" in kinds:
        problems.append(f"{where}: accepted by {[n for n, (k, _) in results.items() if k == 'ok']} only")
    return "ok" if kinds == {"ok"} else "refused" if kinds == {"refused"} else "other"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--examples", type=int, default=40, help="per op")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--op", action="append", help="only these ops")
    parser.add_argument("--executor", action="append", choices=sorted(ALL_EXECUTORS), help="default: every one")
    parser.add_argument("--symbolic", action="store_true", help="models with symbolic dims: shape rules at run time")
    args = parser.parse_args()
    problems: list[str] = []
    tally = {"ok": 0, "refused": 0, "other": 0}

    def run_one(op: str, seed: int, breaks: int) -> None:
        executors = args.executor or tuple(ALL_EXECUTORS)
        tally[check(op, seed + args.seed, breaks, problems, executors, args.symbolic)] += 1

    for op in args.op or OPS:

        @settings(
            max_examples=args.examples,
            derandomize=True,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(st.just(op), st.integers(0, 2**31 - 1), st.integers(0, 2))
        def run(op, seed, breaks):
            run_one(op, seed, breaks)

        run()
    for line in problems:
        print(line)
    print("SUMMARY " + json.dumps({"tally": tally, "problems": len(problems)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
