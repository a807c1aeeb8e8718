"""Refused inputs never take the process down, through either executor.

Every other refusal test runs in process (see the per-op test modules); this one runs a
refused value for every op, and a node refused at session creation, in a fresh interpreter
per executor, because an exception escaping an onnxruntime-extensions Python op aborts the
process (SPEC 2.3) and only a separate process can show that it does not.
"""

from __future__ import annotations

import json

import pytest

from moe_onnx.runtime.session import KERNEL_EXECUTORS as EXECUTORS
from tests.support import run_isolated

PROGRAM = """
import json, numpy as np, onnx, moe_onnx
from onnx import helper
from moe_onnx import single_node_model

i32 = lambda *v: np.array(v, np.int32)
ones = lambda *shape: np.ones(shape, np.float32)
ROUTING = np.array([[1, 0, 1], [0, 1, 1], [1, 1, 0], [1, 0, 1]], np.int8)  # T = 4, E = 3, K = 2
SORTED = i32(0, 5, 3, 6, 1, 4, 2, 7)
CASES = [  # (name, op, inputs, attrs): each passes the static rules and fails on its values
    ("counts do not sum", "MoeReRoutingV2",
     {"tokens": ones(6, 4), "expert_token_num_per_rank": i32(2, 1, 0, 4).reshape(2, 2)}, {"idx_type": 1}),
    ("counts whose sum wraps around", "MoeReRoutingV2",
     {"tokens": np.zeros((0, 8), np.float32), "expert_token_num_per_rank": np.full((2, 2), 2**62, np.int64)}, {}),
    ("expert id out of range", "MoeInitRoutingV2",
     {"x": ones(2, 3), "expert_idx": i32(0, 5, 1, 1).reshape(2, 2)}, {"expert_num": 4}),
    ("grad index out of range", "MoeInitRoutingV2Grad",
     {"grad_expanded_x": ones(4, 3), "expanded_row_idx": i32(0, 1, 2, 9)}, {"top_k": 2}),
    ("int8 map not 0/1", "MoeTokenPermuteWithRoutingMap",
     {"tokens": ones(4, 2), "routing_map": ROUTING * 2}, {"num_out_tokens": 8}),
    ("sorted index out of range", "MoeTokenPermuteWithRoutingMapGrad",
     {"permuted_tokens_grad": ones(8, 2), "permuted_probs_grad": None, "sorted_indices": SORTED * 3},
     {"tokens_num": 4}),
    ("sorted index repeated", "MoeTokenUnpermuteWithRoutingMap",
     {"permuted_tokens": ones(8, 2), "sorted_indices": i32(0, 0, 3, 6, 1, 4, 2, 7)}, {"restore_shape": [4, 2]}),
    ("out index out of range", "MoeTokenUnpermuteWithRoutingMapGrad",
     {"unpermuted_tokens_grad": ones(4, 2), "out_index": SORTED * 2, "permute_token_id": i32(*range(8)) // 2}, {}),
    ("no communicator", "AllToAll", {"data": ones(2, 2), "send_counts": np.array([2], np.int64)}, {}),
]
results = {}
for name, op, inputs, attrs in CASES:
    outputs = [o.name if not o.optional else "" for o in moe_onnx.custom_ops.ALL_OPS["cann.moe", op].outputs]
    model = single_node_model(op, inputs, attrs, outputs)
    feeds = {k: v for k, v in inputs.items() if v is not None}
    try:
        moe_onnx.InferenceSession(model, executor=EXECUTOR).run(None, feeds)
        results[name] = "accepted"
    except moe_onnx.MoeOpError as err:
        results[name] = [err.code, err.op_type, err.node_name]
# refused when the session is made: a node with an attribute out of its choices
node = helper.make_node("MoeReRoutingV2", ["t", "c"], ["a", "b", "i", "n"], domain="cann.moe", name="bad", idx_type=7)
graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("t", onnx.TensorProto.FLOAT, [6, 4]),
                                        helper.make_tensor_value_info("c", onnx.TensorProto.INT32, [2, 2])],
                          [helper.make_tensor_value_info("a", onnx.TensorProto.FLOAT, None)])
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("cann.moe", 1)])
try:
    moe_onnx.InferenceSession(model, executor=EXECUTOR)
    results["bad attribute"] = "accepted"
except moe_onnx.MoeOpError as err:
    results["bad attribute"] = [err.code, err.op_type, err.node_name]
print("RESULTS", json.dumps(results))
"""


@pytest.mark.parametrize("executor", list(EXECUTORS))
def test_refusals_do_not_abort(executor):
    result = run_isolated(f"EXECUTOR = {executor!r}\n" + PROGRAM)
    assert result.returncode == 0, f"the process died ({result.returncode}):\n{result.stderr[-3000:]}"
    line = next(line for line in result.stdout.splitlines() if line.startswith("RESULTS "))
    results = json.loads(line[len("RESULTS ") :])
    assert len(results) == 10
    for name, got in results.items():
        assert got != "accepted", f"{name}: accepted"
        code, op_type, node_name = got
        assert code == 561002 and op_type and node_name in ("node", "bad"), (name, got)
