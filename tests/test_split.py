"""Split execution: graphs mixing native and cann.moe nodes, cut into segments and kernel calls."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import moe_onnx
from moe_onnx.custom_ops import DOMAIN, OPSET_VERSION
from moe_onnx.custom_ops.moe_re_routing_v2 import moe_re_routing_v2
from tests.support import assert_same_bits
from tests.support import run_both_executors as run_both

OPSETS = [helper.make_opsetid("", 21), helper.make_opsetid(DOMAIN, OPSET_VERSION)]
COUNTS = np.array([[2, 1], [0, 3]], np.int32)  # 2 ranks x 2 experts, A = 6


def reroute(tokens: str, counts: str, out: str) -> onnx.NodeProto:
    return helper.make_node("MoeReRoutingV2", [tokens, counts], [out, "", "", ""], domain=DOMAIN, name=f"reroute_{out}")


def model_of(nodes, inputs, outputs, initializers=()) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(initializers))
    return helper.make_model(graph, opset_imports=OPSETS)


def test_native_ours_native_bfloat16_crosses_both_ways():
    """float32 -> Cast(bf16) -> MoeReRoutingV2 -> Cast(float32) -> Mul: bf16 leaves and
    re-enters onnxruntime around our node."""
    x = np.random.default_rng(0).standard_normal((6, 8)).astype(np.float32)
    nodes = [
        helper.make_node("Cast", ["x"], ["x_bf16"], to=TensorProto.BFLOAT16),
        reroute("x_bf16", "counts", "y_bf16"),
        helper.make_node("Cast", ["y_bf16"], ["y"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["y", "y"], ["y2"]),
    ]
    model = model_of(
        nodes,
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [6, 8]),
            helper.make_tensor_value_info("counts", TensorProto.INT32, [2, 2]),
        ],
        [
            helper.make_tensor_value_info("y2", TensorProto.FLOAT, None),
            helper.make_tensor_value_info("y_bf16", TensorProto.BFLOAT16, None),
        ],
    )
    y2, y_bf16 = run_both(model, {"x": x, "counts": COUNTS})
    want = moe_re_routing_v2(x.astype(ml_dtypes.bfloat16), COUNTS)[0]
    assert_same_bits(y_bf16, want)
    assert_same_bits(y2, np.square(want.astype(np.float32)))


def test_initializers_feed_our_node_and_an_output():
    tokens = np.arange(24, dtype=np.float32).reshape(6, 4)
    model = model_of(
        [reroute("tokens", "counts", "y")],
        [helper.make_tensor_value_info("tokens", TensorProto.FLOAT, [6, 4])],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
            helper.make_tensor_value_info("counts", TensorProto.INT32, None),
        ],
        [numpy_helper.from_array(COUNTS, "counts")],
    )
    y, counts = run_both(model, {"tokens": tokens})
    assert_same_bits(y, moe_re_routing_v2(tokens, COUNTS)[0])
    assert_same_bits(counts, COUNTS)


def test_external_initializer_read_by_our_node(tmp_path):
    tokens = np.arange(6 * 1024, dtype=np.float32).reshape(6, 1024)
    model = model_of(
        [reroute("tokens", "counts", "y")],
        [helper.make_tensor_value_info("counts", TensorProto.INT32, [2, 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(tokens, "tokens")],
    )
    path = tmp_path / "m.onnx"
    onnx.save(model, path, save_as_external_data=True, location="m.data", size_threshold=0)
    (y,) = run_both(str(path), {"counts": COUNTS})
    assert_same_bits(y, moe_re_routing_v2(tokens, COUNTS)[0])


def test_external_initializer_of_a_branch_is_read_beside_the_model(tmp_path, monkeypatch):
    """An If branch's own initializer in external data, the session made from another
    folder: the segment holding the If is written beside the model too (was read from the
    working directory: 'should be stored in m.data, but it is not regular file')."""
    bias = np.arange(6 * 4, dtype=np.float32).reshape(6, 4)
    then = helper.make_graph(
        [helper.make_node("Add", ["y", "bias"], ["branch"])],
        "then",
        [],
        [helper.make_tensor_value_info("branch", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(bias, "bias")],
    )
    other = helper.make_graph(
        [helper.make_node("Neg", ["y"], ["branch_else"])],
        "else",
        [],
        [helper.make_tensor_value_info("branch_else", TensorProto.FLOAT, None)],
    )
    nodes = [
        reroute("tokens", "counts", "y"),
        helper.make_node("If", ["flag"], ["z"], then_branch=then, else_branch=other),
    ]
    inputs = [
        helper.make_tensor_value_info("tokens", TensorProto.FLOAT, [6, 4]),
        helper.make_tensor_value_info("counts", TensorProto.INT32, [2, 2]),
        helper.make_tensor_value_info("flag", TensorProto.BOOL, []),
    ]
    model = model_of(nodes, inputs, [helper.make_tensor_value_info("z", TensorProto.FLOAT, None)])
    (tmp_path / "model").mkdir()
    (tmp_path / "elsewhere").mkdir()
    path = tmp_path / "model" / "m.onnx"
    onnx.save(model, path, save_as_external_data=True, location="m.data", size_threshold=0)
    monkeypatch.chdir(tmp_path / "elsewhere")
    tokens = np.arange(24, dtype=np.float32).reshape(6, 4)
    (z,) = run_both(str(path), {"tokens": tokens, "counts": COUNTS, "flag": np.array(True)})
    assert_same_bits(z, moe_re_routing_v2(tokens, COUNTS)[0] + bias)


def test_subgraph_reads_our_output_from_the_outer_scope():
    """An If after our node whose branches use our output without naming it as an input."""
    tokens = np.arange(24, dtype=np.float32).reshape(6, 4)
    then = helper.make_graph(
        [helper.make_node("Neg", ["y"], ["branch"])],
        "then",
        [],
        [helper.make_tensor_value_info("branch", TensorProto.FLOAT, None)],
    )
    other = helper.make_graph(
        [helper.make_node("Abs", ["y"], ["branch_else"])],
        "else",
        [],
        [helper.make_tensor_value_info("branch_else", TensorProto.FLOAT, None)],
    )
    nodes = [
        reroute("tokens", "counts", "y"),
        helper.make_node("If", ["flag"], ["z"], then_branch=then, else_branch=other),
    ]
    model = model_of(
        nodes,
        [
            helper.make_tensor_value_info("tokens", TensorProto.FLOAT, [6, 4]),
            helper.make_tensor_value_info("counts", TensorProto.INT32, [2, 2]),
            helper.make_tensor_value_info("flag", TensorProto.BOOL, []),
        ],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, None)],
    )
    want = moe_re_routing_v2(tokens, COUNTS)[0]
    (z,) = run_both(model, {"tokens": tokens, "counts": COUNTS, "flag": np.array(True)})
    assert_same_bits(z, -want)


def test_input_passed_straight_to_an_output_and_metadata():
    tokens = np.ones((6, 4), np.float32)
    model = model_of(
        [reroute("tokens", "counts", "y")],
        [
            helper.make_tensor_value_info("tokens", TensorProto.FLOAT, ["A", 4]),
            helper.make_tensor_value_info("counts", TensorProto.INT32, [2, 2]),
        ],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
            helper.make_tensor_value_info("counts", TensorProto.INT32, [2, 2]),
        ],
    )
    session = moe_onnx.InferenceSession(model)
    assert [(a.name, a.type, a.shape) for a in session.get_inputs()] == [
        ("tokens", "tensor(float)", ["A", 4]),
        ("counts", "tensor(int32)", [2, 2]),
    ]
    assert [a.name for a in session.get_outputs()] == ["y", "counts"]
    y, counts = session.run(None, {"tokens": tokens, "counts": COUNTS})
    assert_same_bits(counts, COUNTS)
    (only,) = session.run(["counts"], {"tokens": tokens, "counts": COUNTS})
    assert_same_bits(only, COUNTS)


def test_bad_calls_raise_clear_errors():
    tokens = np.ones((6, 4), np.float32)
    model = model_of(
        [reroute("tokens", "counts", "y")],
        [
            helper.make_tensor_value_info("tokens", TensorProto.FLOAT, [6, 4]),
            helper.make_tensor_value_info("counts", TensorProto.INT32, [2, 2]),
        ],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    session = moe_onnx.InferenceSession(model)
    with pytest.raises(ValueError, match="missing required input"):
        session.run(None, {"tokens": tokens})
    with pytest.raises(ValueError, match="unknown input"):
        session.run(None, {"tokens": tokens, "counts": COUNTS, "other": COUNTS})
    with pytest.raises(ValueError, match="unknown output"):
        session.run(["nope"], {"tokens": tokens, "counts": COUNTS})
    with pytest.raises(moe_onnx.MoeOpError, match="reroute_y"):
        session.run(None, {"tokens": tokens, "counts": COUNTS * 2})
    with pytest.raises(ValueError, match="executor"):
        moe_onnx.InferenceSession(model, executor="fast")
    with pytest.raises(AttributeError, match="executor='pyop'"):
        session.get_modelmeta()


def test_our_node_inside_a_subgraph_is_refused():
    branch = helper.make_graph(
        [reroute("tokens", "counts", "y")], "then", [], [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    )
    node = helper.make_node("If", ["flag"], ["z"], then_branch=branch, else_branch=branch)
    model = model_of(
        [node],
        [
            helper.make_tensor_value_info("tokens", TensorProto.FLOAT, [6, 4]),
            helper.make_tensor_value_info("counts", TensorProto.INT32, [2, 2]),
            helper.make_tensor_value_info("flag", TensorProto.BOOL, []),
        ],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, None)],
    )
    with pytest.raises(ValueError, match="subgraph"):
        moe_onnx.InferenceSession(model)


def io(name, elem, shape):
    return helper.make_tensor_value_info(name, elem, shape)


def test_feeds_are_checked_against_the_declared_inputs():
    """Inputs read only by our nodes never reach onnxruntime: the session checks them."""
    model = model_of(
        [reroute("tokens", "counts", "y")],
        [io("tokens", TensorProto.FLOAT, ["A", 4]), io("counts", TensorProto.INT32, [2, 2])],
        [io("y", TensorProto.FLOAT, None)],
    )
    session = moe_onnx.InferenceSession(model)
    with pytest.raises(TypeError, match="'tokens' must be float32, got float16"):
        session.run(None, {"tokens": np.ones((6, 4), np.float16), "counts": COUNTS})
    with pytest.raises(TypeError, match="'counts' must be int32, got int64"):
        session.run(None, {"tokens": np.ones((6, 4), np.float32), "counts": COUNTS.astype(np.int64)})
    with pytest.raises(ValueError, match=r"'tokens' must have shape \['A', 4\], got \[6, 7\]"):
        session.run(None, {"tokens": np.ones((6, 7), np.float32), "counts": COUNTS})


def test_traced_sizes_on_crossing_values_do_not_bind():
    """A value_info recorded at export (y: [6, 4]) must not reject another batch size."""
    counts = np.array([[1, 0], [0, 2]], np.int32)
    model = model_of(
        [reroute("tokens", "counts", "y"), helper.make_node("Neg", ["y"], ["z"])],
        [io("tokens", TensorProto.FLOAT, ["A", 4]), io("counts", TensorProto.INT32, [2, 2])],
        [io("z", TensorProto.FLOAT, None)],
    )
    model.graph.value_info.append(io("y", TensorProto.FLOAT, [6, 4]))
    tokens = np.arange(12, dtype=np.float32).reshape(3, 4)
    (z,) = run_both(model, {"tokens": tokens, "counts": counts})
    assert_same_bits(z, -moe_re_routing_v2(tokens, counts)[0])


def test_scalars_cross_as_scalars_and_dead_nodes_are_skipped():
    tokens = np.ones((6, 4), np.float32)
    nodes = [
        helper.make_node("ReduceSum", ["tokens"], ["total"], keepdims=0),
        reroute("tokens", "counts", "y"),
        helper.make_node("Identity", ["total"], ["total_out"]),
        helper.make_node("Neg", ["y"], ["dead"]),
    ]  # read by nobody
    model = model_of(
        nodes,
        [io("tokens", TensorProto.FLOAT, [6, 4]), io("counts", TensorProto.INT32, [2, 2])],
        [io("total_out", TensorProto.FLOAT, None), io("y", TensorProto.FLOAT, None)],
    )
    total, y = run_both(model, {"tokens": tokens, "counts": COUNTS})
    assert total.shape == () and total == 24


def test_a_constant_output_is_the_callers_copy():
    model = model_of(
        [reroute("tokens", "counts", "y")],
        [io("tokens", TensorProto.FLOAT, [6, 4])],
        [io("y", TensorProto.FLOAT, None), io("counts", TensorProto.INT32, None)],
        [helper.make_tensor("counts", TensorProto.INT32, [2, 2], COUNTS.ravel().tolist())],
    )
    session = moe_onnx.InferenceSession(model)
    _, counts = session.run(None, {"tokens": np.ones((6, 4), np.float32)})
    counts[0, 1] = -2
    _, again = session.run(None, {"tokens": np.ones((6, 4), np.float32)})
    assert_same_bits(again, COUNTS)


def test_malformed_graphs_fail_at_creation():
    inputs = [io("tokens", TensorProto.FLOAT, [6, 4]), io("counts", TensorProto.INT32, [2, 2])]
    orphan = model_of([reroute("tokens", "counts", "y")], inputs, [io("nowhere", TensorProto.FLOAT, None)])
    with pytest.raises(ValueError, match=r"\['nowhere'\] are neither inputs"):
        moe_onnx.InferenceSession(orphan)
    extra = helper.make_node("MoeReRoutingV2", ["tokens", "counts", "", "", "tokens"], ["y"], domain=DOMAIN)
    with pytest.raises(moe_onnx.MoeOpError, match="at most 4 inputs"):
        moe_onnx.InferenceSession(model_of([extra], inputs, [io("y", TensorProto.FLOAT, None)]))
    inner = helper.make_graph([reroute("tokens", "counts", "y")], "inner", [], [io("y", TensorProto.FLOAT, None)])
    outer = helper.make_graph(
        [helper.make_node("If", ["flag"], ["y"], then_branch=inner, else_branch=inner)],
        "outer",
        [],
        [io("y", TensorProto.FLOAT, None)],
    )
    nested = helper.make_node("If", ["flag"], ["z"], then_branch=outer, else_branch=outer)
    model = model_of([nested], inputs + [io("flag", TensorProto.BOOL, [])], [io("z", TensorProto.FLOAT, None)])
    for executor in moe_onnx.runtime.session.KERNEL_EXECUTORS:
        with pytest.raises(ValueError, match="subgraph"):
            moe_onnx.InferenceSession(model, executor=executor)


def test_segment_workers_do_not_spin_unless_asked():
    import onnxruntime as ort

    model = model_of(
        [helper.make_node("Neg", ["x"], ["y"])], [io("x", TensorProto.FLOAT, [2])], [io("y", TensorProto.FLOAT, None)]
    )
    options = ort.SessionOptions()
    moe_onnx.InferenceSession(model, options)
    assert options.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    asked = ort.SessionOptions()
    asked.add_session_config_entry("session.intra_op.allow_spinning", "1")
    moe_onnx.InferenceSession(model, asked)
    assert asked.get_session_config_entry("session.intra_op.allow_spinning") == "1"


def test_sparse_initializer_stays_inside_its_segment():
    tokens = np.ones((6, 4), np.float32)
    dense = np.zeros((6, 4), np.float32)
    dense[1, 2] = 5
    values = numpy_helper.from_array(np.array([5], np.float32), "w")
    sparse = helper.make_sparse_tensor(values, numpy_helper.from_array(np.array([6], np.int64), "w_idx"), [6, 4])
    model = model_of(
        [reroute("tokens", "counts", "y"), helper.make_node("Add", ["y", "w"], ["z"])],
        [io("tokens", TensorProto.FLOAT, [6, 4]), io("counts", TensorProto.INT32, [2, 2])],
        [io("z", TensorProto.FLOAT, None)],
    )
    model.graph.sparse_initializer.append(sparse)
    (z,) = moe_onnx.InferenceSession(model).run(None, {"tokens": tokens, "counts": COUNTS})
    assert_same_bits(z, moe_re_routing_v2(tokens, COUNTS)[0] + dense)


def test_a_node_infers_once_per_shape_and_still_checks_every_call(monkeypatch):
    """The split executor keeps each node's signature per input shape (NodeSignatures): a
    shape seen before is not inferred again, a new shape is (and refused when it breaks a
    rule), and the output-size limit is checked on every call."""
    from moe_onnx.custom_ops import OPS

    node = helper.make_node("SwiGlu", ["x"], ["y"], domain=DOMAIN, name="act")
    model = model_of(
        [node],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", "F"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["T", None])],
    )
    session = moe_onnx.InferenceSession(model)
    inferred = []
    real_infer = OPS["SwiGlu"].infer
    monkeypatch.setattr(OPS["SwiGlu"], "infer", lambda sig: (inferred.append(sig.input("x").shape), real_infer(sig)))
    x = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
    for _ in range(3):
        (y,) = session.run(None, {"x": x})
    a, b = x[:, :4], x[:, 4:]
    np.testing.assert_allclose(y, a / (1 + np.exp(-a)) * b, rtol=1e-6)
    assert inferred == [(3, 8)]
    with pytest.raises(moe_onnx.MoeOpError, match=r"SwiGlu.*'act'.*even size"):
        session.run(None, {"x": x[:, :7].copy()})
    assert inferred == [(3, 8), (3, 7)]
    monkeypatch.setenv("MOE_ONNX_MAX_BYTES", "32")  # y is 48 bytes
    with pytest.raises(moe_onnx.MoeOpError, match="more than the 32 bytes allowed"):
        session.run(None, {"x": x})
    assert inferred == [(3, 8), (3, 7)]
