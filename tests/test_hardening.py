"""What a hostile model or feed gets (issue 14): a MoeOpError naming the op, the node and the
rule, never an abort, a foreign exception, or a silently different result."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import moe_onnx
from moe_onnx.runtime.session import KERNEL_EXECUTORS as EXECUTORS
from tests.support import assert_refused, node_model, run_isolated, run_node

TOKENS = np.arange(24, dtype=np.float32).reshape(6, 4)
COUNTS = np.array([[2, 1], [0, 3]], np.int32)
REROUTING_OUTPUTS = ["permute_tokens", "permute_per_token_scales", "permute_token_idx", "expert_token_num", ""]


def rerouting_model(tokens=TOKENS, counts=COUNTS, **attrs) -> onnx.ModelProto:
    inputs = {"tokens": tokens, "expert_token_num_per_rank": counts}
    return node_model("MoeReRoutingV2", inputs, attrs, REROUTING_OUTPUTS)


@pytest.mark.parametrize("executor", list(EXECUTORS))
def test_counts_whose_sum_wraps_around_are_refused(executor):
    """4 * 2**62 wraps to 0 = A in int64: the sum check alone let np.repeat run (a segfault)."""
    tokens, counts = np.zeros((0, 8), np.float32), np.full((2, 2), 2**62, np.int64)
    session = moe_onnx.InferenceSession(rerouting_model(tokens, counts), executor=executor)
    err = assert_refused(
        lambda: session.run(None, {"tokens": tokens, "expert_token_num_per_rank": counts}),
        561002,
        "expert_token_num_per_rank[0, 0] = 4611686018427387904 exceeds A = tokens.shape[0] = 0",
    )
    assert err.op_type == "MoeReRoutingV2" and err.node_name == "node"


def test_empty_count_grids_are_zero_rows():
    for counts in (np.zeros((2, 0), np.int32), np.zeros((0, 3), np.int32)):
        got = run_node(
            "MoeReRoutingV2",
            {"tokens": np.zeros((0, 4), np.float32), "expert_token_num_per_rank": counts},
            outputs=REROUTING_OUTPUTS,
        )
        assert got[0].shape == (0, 4) and got[3].shape == (counts.shape[1],)


def test_a_float_attribute_where_an_int_is_declared_is_refused():
    """onnx.checker refuses active_num=0.5; so does every session (it used to change the result)."""
    x, expert_idx = np.ones((4, 3), np.float32), np.array([[0, 1], [2, 1], [1, 1], [0, 2]], np.int32)
    node = helper.make_node(
        "MoeInitRoutingV2", ["x", "expert_idx"], ["y", "row_idx"], domain="cann.moe", name="init", active_num=0.5
    )
    graph = helper.make_graph(
        [node],
        "g",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 3]),
            helper.make_tensor_value_info("expert_idx", TensorProto.INT32, [4, 2]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("cann.moe", 1)])
    with pytest.raises(onnx.checker.ValidationError):
        onnx.checker.check_model(model, full_check=True)
    for executor in EXECUTORS:
        err = assert_refused(
            lambda executor=executor: moe_onnx.InferenceSession(model, executor=executor),
            561002,
            "'active_num' must be",
        )
        assert err.node_name == "init"
    assert_refused(
        lambda: moe_onnx.OPS["MoeInitRoutingV2"](x, expert_idx, active_num=0.5),
        561002,
        "attribute 'active_num' must be an integer, got 0.5 (float)",
    )


@pytest.mark.parametrize("value", ["x", [1, 2], 2**64, 0.5, 1.0])
def test_attributes_of_another_kind_are_moe_op_errors(value):
    assert_refused(lambda: moe_onnx.OPS["MoeReRoutingV2"](TOKENS, COUNTS, idx_type=value), 561002, "'idx_type'")


def test_a_bool_is_an_int_attribute_in_calls_and_sessions():
    """SPEC-layer 1.18: ``padded_mode=False`` means 0 (torch_npu passes bools)."""
    want = moe_onnx.OPS["MoeReRoutingV2"](TOKENS, COUNTS, idx_type=1)
    for value in (True, np.bool_(True)):
        got = moe_onnx.OPS["MoeReRoutingV2"](TOKENS, COUNTS, idx_type=value)
        assert all(np.array_equal(g, w) for g, w in zip(got, want) if w is not None)
    for executor in EXECUTORS:  # helper.make_attribute writes a bool as an INT attribute
        got = moe_onnx.InferenceSession(rerouting_model(idx_type=True), executor=executor).run(
            None, {"tokens": TOKENS, "expert_token_num_per_rank": COUNTS}
        )
        assert np.array_equal(got[2], want[2])
    rows = moe_onnx.OPS["MoeTokenUnpermuteWithRoutingMap"](
        TOKENS, np.array([0, 3, 1, 4, 2, 5], np.int32), restore_shape=[True, 4], padded_mode=False
    )[0]
    assert rows.shape == (1, 4)


def test_byte_swapped_feeds_are_read_as_their_values():
    want = run_node(
        "MoeReRoutingV2", {"tokens": TOKENS, "expert_token_num_per_rank": COUNTS}, outputs=REROUTING_OUTPUTS
    )
    swapped = {"tokens": TOKENS.astype(">f4"), "expert_token_num_per_rank": COUNTS.astype(">i4")}
    for executor in EXECUTORS:
        got = moe_onnx.InferenceSession(rerouting_model(), executor=executor).run(None, swapped)
        for g, w in zip(got, want):
            assert g.dtype == w.dtype and np.array_equal(g, w)
    bare = moe_onnx.OPS["MoeReRoutingV2"](*swapped.values())
    assert np.array_equal(bare[0], want[0])


def test_an_output_declared_of_another_type_is_refused():
    model = rerouting_model(TOKENS.astype(ml_dtypes.bfloat16))
    model.graph.output[0].type.tensor_type.elem_type = TensorProto.DOUBLE
    for executor in EXECUTORS:
        assert_refused(
            lambda executor=executor: moe_onnx.InferenceSession(model, executor=executor),
            561002,
            "declares 'permute_tokens' (output permute_tokens) as float64 of rank 2, but the op gives bfloat16",
        )


def test_an_untyped_output_comes_back_in_its_real_dtype():
    """The pyop executor returned the uint16 carrier of a float16 output the graph left untyped."""
    model = rerouting_model(TOKENS.astype(np.float16))
    model.graph.output[0].type.CopyFrom(onnx.TypeProto())
    feeds = {"tokens": TOKENS.astype(np.float16), "expert_token_num_per_rank": COUNTS}
    for executor in EXECUTORS:
        out = moe_onnx.InferenceSession(model, executor=executor).run(None, feeds)[0]
        assert out.dtype == np.float16


def test_duplicate_names_are_refused():
    model = rerouting_model()
    model.graph.output.append(model.graph.output[0])
    with pytest.raises(ValueError, match=r"graph output\(s\) \['permute_tokens'\] are listed more than once"):
        moe_onnx.InferenceSession(model)
    model = rerouting_model()
    identity = helper.make_node("Identity", ["tokens"], ["permute_token_idx"], name="twice")
    model.graph.node.append(identity)
    with pytest.raises(ValueError, match="'permute_token_idx' is defined twice"):
        moe_onnx.InferenceSession(model)


def test_an_extra_node_output_is_refused():
    model = rerouting_model()
    model.graph.node[0].output.extend(["extra", "extra2"])
    model.graph.output.append(helper.make_tensor_value_info("extra2", TensorProto.FLOAT, None))
    for executor in EXECUTORS:
        assert_refused(
            lambda executor=executor: moe_onnx.InferenceSession(model, executor=executor), 561002, "has 7 outputs"
        )


def test_sizes_past_the_limit_are_refused_before_allocating(monkeypatch):
    """Attribute-sized outputs of TiB (zero-byte inputs) are a MoeOpError naming the size,
    not a MemoryError; the limit is MOE_ONNX_MAX_BYTES."""
    x, expert_idx = np.zeros((0, 4), np.float32), np.zeros((0, 2), np.int32)
    init = moe_onnx.OPS["MoeInitRoutingV2"]
    assert_refused(lambda: init(x, expert_idx, expert_num=2**40), 561002, "8796093022208 bytes")
    unpermute = moe_onnx.OPS["MoeTokenUnpermuteWithRoutingMap"]
    no_rows = np.zeros((0, 2**20), np.float32)  # zero bytes, claiming H = 2**20
    assert_refused(
        lambda: unpermute(no_rows, np.zeros(0, np.int32), restore_shape=[2**20, 2**20]),
        561002,
        "the outputs unpermuted_tokens [1048576, 1048576] float32",
        "would take 4398046511104 bytes",
    )
    monkeypatch.setenv("MOE_ONNX_MAX_BYTES", "1000")
    big = np.zeros((100, 4), np.float32)  # 1600 bytes of outputs
    assert_refused(
        lambda: moe_onnx.OPS["MoeReRouting"](big, np.array([[100]], np.int32)),
        561002,
        "more than the 1000 bytes allowed (set MOE_ONNX_MAX_BYTES to change the limit)",
    )


def test_a_huge_attribute_is_not_echoed_whole():
    text = "x" * (64 << 20)
    err = assert_refused(lambda: moe_onnx.OPS["MoeReRoutingV2"](TOKENS, COUNTS, tokens_dtype=text), 561002)
    assert len(str(err)) < 3000


def test_crafted_pyop_configs_do_not_abort():
    """A prepared model whose PyOp config was edited in the file (ranks out of range or not
    integers, an attribute out of its choices): a plain onnxruntime session logs the refusal
    and returns empty outputs. The hook's own error path, taken when the kernel refuses its
    input, used to raise with such a config (an abort)."""
    program = """
import json, sys, numpy as np, onnxruntime as ort, moe_onnx
counts = np.array([[2, 1]], np.int32); tokens = np.ones((3, 4), np.float32)
model = moe_onnx.single_node_model("MoeReRoutingV2", {"tokens": tokens, "expert_token_num_per_rank": counts},
                                   outputs=["a", "b", "c", "d", ""])
prepared = moe_onnx.prepare_for_ort(model)
options = moe_onnx.session_options()
edits = [{"output_ranks": [100, 1, 1, 1, 1]}, {"output_ranks": [1.5, 1, 1, 1, 1]}, {"output_ranks": "x"},
         {"attrs": {"idx_type": 7, "expert_token_num_type": 1, "tokens_dtype": None}}, {"context": "nope"}, {}]
for edit in edits:
    crafted = type(prepared)(); crafted.CopyFrom(prepared)
    node = crafted.graph.node[0]
    config = json.loads(node.attribute[0].s) if edit else None
    node.attribute[0].s = (json.dumps({**config, **edit}) if edit else "not json").encode()
    session = ort.InferenceSession(crafted.SerializeToString(), options, providers=["CPUExecutionProvider"])
    out = session.run(None, {"tokens": tokens, "expert_token_num_per_rank": counts * 2})  # refused
    print("SIZES", [o.size for o in out], flush=True)
print("DONE")
"""
    result = run_isolated(program)
    assert result.returncode == 0, f"the process died ({result.returncode}):\n{result.stderr[-3000:]}"
    assert result.stdout.count("SIZES [0, 0, 0, 0]") == 6 and "DONE" in result.stdout


def test_pyop_sessions_made_from_many_threads():
    """Lazy PyOp registration while other threads create sessions: a lock serialises the
    extensions' registry and session creation (a segfault in 2 of 70 processes before)."""
    program = """
import threading, numpy as np, ml_dtypes, moe_onnx
TYPES = [np.float32, np.float16, ml_dtypes.bfloat16, np.int8, np.uint8, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2]
errors = []
def work(i):
    try:
        tokens = np.ones((6, 3), TYPES[i % len(TYPES)])
        counts = np.array([[2, 1], [0, 3]], [np.int32, np.int64][i // len(TYPES) % 2])
        model = moe_onnx.single_node_model("MoeReRoutingV2", {"tokens": tokens, "expert_token_num_per_rank": counts},
                                           {"idx_type": i % 2}, outputs=["a", "b", "c", "d", ""])
        session = moe_onnx.InferenceSession(model, executor="split" if i % 4 == 0 else "pyop")
        session.run(None, {"tokens": tokens, "expert_token_num_per_rank": counts})
    except Exception as err:
        errors.append(repr(err))
threads = [threading.Thread(target=work, args=(i,)) for i in range(16)]
for t in threads: t.start()
for t in threads: t.join()
print("ERRORS", errors)
"""
    result = run_isolated(program)
    assert result.returncode == 0, f"the process died ({result.returncode}):\n{result.stderr[-3000:]}"
    assert "ERRORS []" in result.stdout, result.stdout


def test_every_refusal_pickles_with_its_fields():
    """Errors cross MPI ranks and subprocesses pickled."""
    import pickle

    err = moe_onnx.MoeOpError("rule", 161002, op_type="Op", node_name="n")
    back = pickle.loads(pickle.dumps(err))
    assert (back.rule, back.code, back.op_type, back.node_name, str(back)) == ("rule", 161002, "Op", "n", str(err))
    feed = moe_onnx.custom_ops.errors.FeedError("bad feed", 161002)
    back = pickle.loads(pickle.dumps(feed))
    assert isinstance(back, TypeError) and isinstance(back, moe_onnx.MoeOpError) and str(back) == str(feed)


def test_one_session_options_serves_several_sessions():
    """The extensions library is registered once per SessionOptions (twice failed: 'Conflicting
    with a registered kernel'); options that cannot see a model's newer Python ops are refused
    with a message saying to pass new ones. In a fresh interpreter: whether a signature is
    new depends on what the process ran before."""
    program = """
import ml_dtypes, numpy as np, onnxruntime as ort, moe_onnx
def model(tokens, counts, **attrs):
    inputs = {"tokens": tokens, "expert_token_num_per_rank": counts}
    return moe_onnx.single_node_model("MoeReRoutingV2", inputs, attrs, outputs=["a", "b", "c", "d", ""])
tokens, counts = np.ones((6, 3), np.float32), np.array([[2, 1], [0, 3]], np.int32)
options = ort.SessionOptions()
for executor in ("pyop", "pyop", "split"):
    session = moe_onnx.InferenceSession(model(tokens, counts), options, executor=executor)
    session.run(None, {"tokens": tokens, "expert_token_num_per_rank": counts})
novel = model(tokens.astype(ml_dtypes.float8_e5m2), counts.astype(np.int64), idx_type=1)
try:
    moe_onnx.InferenceSession(novel, options, executor="pyop")
except ValueError as err:
    print("REFUSED", err)
moe_onnx.InferenceSession(novel, executor="pyop")  # fresh options work
print("DONE")
"""
    result = run_isolated(program)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "REFUSED" in result.stdout and "pass new SessionOptions" in result.stdout, result.stdout
    assert result.stdout.rstrip().endswith("DONE"), result.stdout


def test_an_output_that_is_a_feed_is_a_copy():
    identity = helper.make_node("Identity", ["x"], ["y"])
    value = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    graph = helper.make_graph(
        [identity], "g", [value], [value, helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])]
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    x = np.ones(2, np.float32)
    for executor in EXECUTORS:
        out = moe_onnx.InferenceSession(model, executor=executor).run(None, {"x": x})
        assert not any(np.shares_memory(o, x) for o in out)
