"""The split executor's expert chain step (moe_onnx/runtime/chains.py): GroupedMatmul -> SwiGlu ->
GroupedMatmul -> MoeFinalizeRoutingV2 as one compiled call at decode, with the four ops' bits."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from onnx import TensorProto, helper

import moe_onnx
from moe_onnx.custom_ops import ALL_OPS, DOMAIN, OPSET_VERSION, MoeOpError, expert_chain, parallel

#: two hit experts read >= 2 MB of each weight even in bfloat16: each product splits into shares
H, INNER, E = 512, 1024, 4
BF16 = np.dtype(ml_dtypes.bfloat16)


@pytest.fixture
def two_workers(monkeypatch):
    """workers() == 2 whatever the machine (on one the chain is never taken)."""
    monkeypatch.setattr(parallel, "_cpu_count", lambda: 2)
    monkeypatch.setattr(parallel, "_MAX_WORKERS", 4)


@pytest.fixture
def taken(monkeypatch):
    """What the chain kernels did per call: "chain" (the four nodes computed), "declined"
    (nothing: the node steps ran), "dispatch + chain", "dispatch only" (the four node steps ran
    on its outputs), "dispatch declined", each of the last three after "gating + " when the
    kernel gated too."""
    calls: list[str] = []
    chain, dispatch = expert_chain.experts_and_combine, expert_chain.dispatch_experts_and_combine

    def counted_chain(*args):
        result = chain(*args)
        calls.append("declined" if result is None else "chain")
        return result

    def counted_dispatch(*args, **kwargs):
        result = dispatch(*args, **kwargs)
        gating = "gating + " if "logits" in kwargs else ""
        if result is None:
            calls.append(gating + "dispatch declined")
        else:
            calls.append(gating + ("dispatch only" if result.chain is None else "dispatch + chain"))
        return result

    monkeypatch.setattr(expert_chain, "experts_and_combine", counted_chain)
    monkeypatch.setattr(expert_chain, "dispatch_experts_and_combine", counted_dispatch)
    return calls


def _elem(dtype) -> int:
    return TensorProto.BFLOAT16 if dtype == BF16 else TensorProto.FLOAT


def layer_model(k: int, dtype, drop_pad_mode: int = 2, group_list_type: int = 1):
    """Gating -> dispatch -> the chain; every intermediate a graph output."""

    def op(op_type, inputs, outputs, **attrs):
        return helper.make_node(op_type, inputs, outputs, domain=DOMAIN, name=op_type + "_" + outputs[0], **attrs)

    grouped = {"group_type": 0, "group_list_type": group_list_type, "transpose_weight": 1}
    nodes = [
        op("MoeGatingTopKSoftmax", ["logits"], ["probs", "ids"], k=k),
        op(
            "MoeInitRoutingV3",
            ["x", "ids"],
            ["rows", "row_idx", "counts"],
            expert_num=E,
            expert_tokens_num_type=group_list_type,
            expert_tokens_num_flag=1,
        ),
        op("GroupedMatmul", ["rows", "w13", "", "counts"], ["gate_up"], **grouped),
        op("SwiGlu", ["gate_up"], ["act"]),
        op("GroupedMatmul", ["act", "w2", "", "counts"], ["down"], **grouped),
        op("MoeFinalizeRoutingV2", ["down", "row_idx", "", "", "", "probs"], ["y"], drop_pad_mode=drop_pad_mode),
    ]
    elem = _elem(dtype)
    names = ["probs", "ids", "rows", "row_idx", "counts", "gate_up", "act", "down", "y"]
    graph = helper.make_graph(
        nodes,
        "expert_chain",
        [
            helper.make_tensor_value_info("x", elem, ["T", H]),
            helper.make_tensor_value_info("logits", elem, ["T", E]),
            helper.make_tensor_value_info("w13", elem, [E, 2 * INNER, H]),
            helper.make_tensor_value_info("w2", elem, [E, H, INNER]),
        ],
        [helper.make_tensor_value_info(name, TensorProto.UNDEFINED, None) for name in names],
    )
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid(DOMAIN, OPSET_VERSION)]
    return helper.make_model(graph, opset_imports=opsets), names


def feeds_of(tokens: int, dtype, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "x": rng.standard_normal((tokens, H), np.float32).astype(dtype),
        "logits": rng.standard_normal((tokens, E), np.float32).astype(dtype),
        "w13": (rng.standard_normal((E, 2 * INNER, H), np.float32) / 16).astype(dtype),
        "w2": (rng.standard_normal((E, H, INNER), np.float32) / 16).astype(dtype),
    }


def one_by_one(feeds: dict, k: int, drop_pad_mode: int, group_list_type: int) -> dict[str, np.ndarray]:
    """The six ops called one at a time (the per-node route)."""

    def run(name, *inputs, **attrs):
        return ALL_OPS[(DOMAIN, name)](*inputs, **attrs)

    grouped = {"group_type": 0, "group_list_type": group_list_type, "transpose_weight": 1}
    probs, ids, _ = run("MoeGatingTopKSoftmax", feeds["logits"], k=k)
    rows, row_idx, counts, _ = run(
        "MoeInitRoutingV3",
        feeds["x"],
        ids,
        expert_num=E,
        expert_tokens_num_type=group_list_type,
        expert_tokens_num_flag=1,
        wanted={"expanded_x", "expanded_row_idx", "expert_tokens_count_or_cumsum"},
    )
    (gate_up,) = run("GroupedMatmul", rows, feeds["w13"], None, counts, **grouped)
    (act,) = run("SwiGlu", gate_up)
    (down,) = run("GroupedMatmul", act, feeds["w2"], None, counts, **grouped)
    (y,) = run("MoeFinalizeRoutingV2", down, row_idx, None, None, None, probs, drop_pad_mode=drop_pad_mode)
    values = (probs, ids, rows, row_idx, counts, gate_up, act, down, y)
    return dict(zip(("probs", "ids", "rows", "row_idx", "counts", "gate_up", "act", "down", "y"), values, strict=True))


def dense_layer(feeds: dict, k: int) -> np.ndarray:
    """The layer in float64 numpy from its definition: softmax top-k weights, SwiGLU experts."""
    x, logits = (feeds[n].astype(np.float64) for n in ("x", "logits"))
    w13, w2 = (feeds[n].astype(np.float64) for n in ("w13", "w2"))
    probs = np.exp(logits - logits.max(1, keepdims=True))
    probs /= probs.sum(1, keepdims=True)
    y = np.zeros_like(x)
    for t in range(len(x)):
        for e in np.argsort(-probs[t], kind="stable")[:k]:
            h = w13[e] @ x[t]
            gate, up = h[:INNER], h[INNER:]
            y[t] += probs[t, e] * (w2[e] @ (gate / (1 + np.exp(-gate)) * up))
    return y


@pytest.mark.parametrize("dtype", [np.dtype(np.float32), BF16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize(("drop_pad_mode", "group_list_type"), [(2, 1), (0, 0)])
def test_the_chain_gives_the_ops_bits(dtype, drop_pad_mode, group_list_type, two_workers, taken):
    """Decode sizes: the first call at a shape runs the four nodes (their checks), later ones
    the chain kernel; every output of every node equals the ops run one by one, bit for bit."""
    k = 2
    model, names = layer_model(k, dtype, drop_pad_mode, group_list_type)
    session = moe_onnx.InferenceSession(model)
    for tokens in (1, 3, 3, 4, 4):
        feeds = feeds_of(tokens, dtype, seed=tokens)
        got = dict(zip(names, session.run(None, feeds), strict=True))
        want = one_by_one(feeds, k, drop_pad_mode, group_list_type)
        for name in names:
            assert got[name].dtype == want[name].dtype, name
            assert got[name].shape == want[name].shape, name
            np.testing.assert_array_equal(got[name].view(np.uint8), want[name].view(np.uint8), err_msg=name)
        if drop_pad_mode == 2:  # the layer (mode 0 reads MoeInitRoutingV3's slots as column-arranged)
            reference = dense_layer(feeds, k)
            tolerance = (2e-6 if dtype == np.float32 else 2e-2) * np.abs(reference).max()
            assert np.abs(got["y"].astype(np.float64) - reference).max() <= tolerance
    # the repeated shapes (3 and 4 tokens) run the chain kernel; the logits gate in it too
    # (bfloat16's probabilities rounded to bfloat16, the gating's y, before the combine)
    assert taken == ["gating + dispatch + chain"] * 2


def test_groups_past_the_lane_dots_run_the_four_nodes(two_workers, taken):
    """More rows for an expert than GroupedMatmul gives the lane dots: the kernel dispatches,
    the four nodes run on its rows; more slots than the lane dots take in all the groups
    together (48 rows over 4 experts of at most 8), the six nodes run (their dispatch copies
    the rows on every thread). The same results as one by one, each way."""
    dtype, k = np.dtype(np.float32), 2
    model, names = layer_model(k, dtype)
    session = moe_onnx.InferenceSession(model)
    one_expert_first = feeds_of(16, dtype)  # 32 rows over 4 experts, expert 0 first for all 16 tokens
    one_expert_first["logits"][:, 0] = 8
    for feeds in (one_expert_first, feeds_of(24, dtype)):
        session.run(None, feeds)
        got = dict(zip(names, session.run(None, feeds), strict=True))
        want = one_by_one(feeds, k, 2, 1)
        for name in names:
            np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    assert taken == ["gating + dispatch only", "gating + dispatch declined"]


def chain_model(dtype):
    """The four chain nodes alone: rows, counts, row_idx and scales are graph inputs."""
    elem = _elem(dtype)
    grouped = {"group_type": 0, "group_list_type": 1, "transpose_weight": 1}

    def op(op_type, inputs, outputs, **attrs):
        return helper.make_node(op_type, inputs, outputs, domain=DOMAIN, name=op_type + "_" + outputs[0], **attrs)

    nodes = [
        op("GroupedMatmul", ["rows", "w13", "", "counts"], ["gate_up"], **grouped),
        op("SwiGlu", ["gate_up"], ["act"]),
        op("GroupedMatmul", ["act", "w2", "", "counts"], ["down"], **grouped),
        op("MoeFinalizeRoutingV2", ["down", "row_idx", "", "", "", "scales"], ["y"], drop_pad_mode=2),
    ]
    graph = helper.make_graph(
        nodes,
        "chain",
        [
            helper.make_tensor_value_info("rows", elem, ["M", H]),
            helper.make_tensor_value_info("w13", elem, [E, 2 * INNER, H]),
            helper.make_tensor_value_info("w2", elem, [E, H, INNER]),
            helper.make_tensor_value_info("counts", TensorProto.INT64, [E]),
            helper.make_tensor_value_info("row_idx", TensorProto.INT32, ["S"]),
            helper.make_tensor_value_info("scales", elem, ["T", "K"]),
        ],
        [helper.make_tensor_value_info("y", elem, ["T", H])],
    )
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid(DOMAIN, OPSET_VERSION)]
    return helper.make_model(graph, opset_imports=opsets)


def test_values_an_op_refuses_raise_its_error(two_workers, taken):
    """After a good call at the same shapes, a row index out of range and counts past the rows
    are refused by the node that checks them, named, as without the chain."""
    dtype = np.dtype(np.float32)
    session = moe_onnx.InferenceSession(chain_model(dtype))
    weights = feeds_of(1, dtype)
    rng = np.random.default_rng(5)
    good = {
        "rows": rng.standard_normal((4, H), np.float32),
        "w13": weights["w13"],
        "w2": weights["w2"],
        "counts": np.array([2, 0, 1, 1], np.int64),
        "row_idx": np.array([0, 2, 1, 3], np.int32),
        "scales": rng.random((2, 2), np.float32),
    }
    session.run(None, good)
    (y,) = session.run(None, good)
    assert taken == ["chain"]
    want = ALL_OPS[(DOMAIN, "MoeFinalizeRoutingV2")](
        *one_chain(good), good["row_idx"], None, None, None, good["scales"], drop_pad_mode=2
    )[0]
    np.testing.assert_array_equal(y, want)
    with pytest.raises(MoeOpError, match=r"MoeFinalizeRoutingV2_y.*expanded_row_idx values must be in \[0, 4\)"):
        session.run(None, {**good, "row_idx": np.array([0, 2, 1, 4], np.int32)})
    with pytest.raises(MoeOpError, match=r"GroupedMatmul_gate_up.*the groups cover 5 rows"):
        session.run(None, {**good, "counts": np.array([2, 0, 1, 2], np.int64)})
    assert taken == ["chain", "declined", "declined"]


def one_chain(feeds: dict) -> tuple[np.ndarray]:
    """GroupedMatmul -> SwiGlu -> GroupedMatmul, one op at a time: ``(down,)``."""
    grouped = {"group_type": 0, "group_list_type": 1, "transpose_weight": 1}
    gmm, glu = ALL_OPS[(DOMAIN, "GroupedMatmul")], ALL_OPS[(DOMAIN, "SwiGlu")]
    (gate_up,) = gmm(feeds["rows"], feeds["w13"], None, feeds["counts"], **grouped)
    (act,) = glu(gate_up)
    return gmm(act, feeds["w2"], None, feeds["counts"], **grouped)


def dispatch_model(k: int, dtype):
    """The layer without its gating: ids and probs are graph inputs."""
    model, _ = layer_model(k, dtype)
    graph = model.graph
    graph.node.remove(graph.node[0])  # the gating: ids and probs are fed
    del graph.input[1]  # the logits
    graph.input.extend(
        [
            helper.make_tensor_value_info("ids", TensorProto.INT32, ["T", k]),
            helper.make_tensor_value_info("probs", TensorProto.FLOAT, ["T", k]),
        ]
    )
    kept = [out for out in graph.output if out.name not in ("probs", "ids")]
    del graph.output[:]
    graph.output.extend(kept)
    return model


def test_ids_the_dispatch_refuses_raise_its_error(two_workers, taken):
    """The dispatch with its ids fed: an id past the experts is MoeInitRoutingV3's error; a
    negative one (dropless: a slot no row takes) is the combine's, as without the chain."""
    dtype, k = np.dtype(np.float32), 2
    session = moe_onnx.InferenceSession(dispatch_model(k, dtype))
    feeds = feeds_of(2, dtype)
    del feeds["logits"]
    feeds |= {"ids": np.array([[0, 1], [2, 1]], np.int32), "probs": np.full((2, k), 0.5, np.float32)}
    session.run(None, feeds)
    session.run(None, feeds)
    with pytest.raises(MoeOpError, match=r"MoeInitRoutingV3_rows.*expert_idx must be .*got 4 at \[1, 0\]"):
        session.run(None, {**feeds, "ids": np.array([[0, 1], [4, 1]], np.int32)})
    with pytest.raises(MoeOpError, match=r"MoeFinalizeRoutingV2_y.*expanded_row_idx values must be in"):
        session.run(None, {**feeds, "ids": np.array([[0, 1], [-1, 1]], np.int32)})
    assert taken == ["dispatch + chain", "dispatch declined", "dispatch declined"]


def test_helpers_keep_polling_while_a_compiled_caller_holds_them():
    """A compiled caller posts its second call without a notify: while HOLD is set a helper's
    server polls on past its poll budget (here none) until a call comes; clear, it returns."""
    import threading
    import time

    from moe_onnx.custom_ops import fused_loops

    counters = np.zeros(9, np.int64)
    counters[parallel.CALLER_CPU] = -1
    descriptor = np.zeros(parallel.DESCRIPTOR_SLOTS, np.int64)
    assert fused_loops.serve_compiled_calls(counters, descriptor, 0, 0, -1) == (0, parallel.IDLE)
    counters[parallel.HOLD] = 1
    returned: list[tuple[int, int]] = []
    serve = fused_loops.serve_compiled_calls
    helper = threading.Thread(target=lambda: returned.append(serve(counters, descriptor, 0, 0, -1)))
    helper.start()
    time.sleep(0.05)
    assert helper.is_alive() and not returned, "with HOLD set the server went back to block"
    counters[parallel.POSTED] = 1  # a Python call (COMPILED differs)
    helper.join(10)
    assert returned == [(1, parallel.PYTHON_CALL)]


def test_a_helper_on_its_callers_core_moves_off_it_once_per_call():
    """A compiled call posted from the core the helper runs on: the server returns (the call
    seen again next time) so that the helper moves to another core of the process's; asked
    again for the same call (moved_for), it joins wherever it runs."""
    import os
    import threading

    from moe_onnx.custom_ops import fused_loops

    allowed = sorted(os.sched_getaffinity(0))
    results: dict = {}
    assert parallel._current_cpu() in allowed  # (Linux: sched_getcpu answers)

    def on_one_core():
        os.sched_setaffinity(0, {allowed[0]})
        counters = np.zeros(9, np.int64)
        descriptor = np.zeros(parallel.DESCRIPTOR_SLOTS, np.int64)  # no seats: it joins, runs nothing
        counters[parallel.POSTED] = counters[parallel.COMPILED] = 1
        counters[parallel.CALLER_CPU] = allowed[0]
        results["first"] = fused_loops.serve_compiled_calls(counters, descriptor, 0, 0, -1)
        results["again"] = fused_loops.serve_compiled_calls(counters, descriptor, 0, 0, 1)
        parallel._move_off(allowed[0], frozenset(allowed))
        results["cpu"] = parallel._current_cpu()
        results["cores"] = os.sched_getaffinity(0)

    thread = threading.Thread(target=on_one_core)
    thread.start()
    thread.join(10)
    assert results["first"] == (0, parallel.ON_CALLERS_CORE)
    assert results["again"] == (1, parallel.IDLE)
    # off the caller's core where it may run on another (else it stays where it was)
    assert (results["cpu"] != allowed[0]) == (len(allowed) > 1)
    assert results["cores"] == (set(allowed) - {allowed[0]} or {allowed[0]})


def test_a_waiting_caller_returns_once_the_helpers_have_left():
    """spin.wait_until_zero: polls, then gives its core up between polls, until the count is 0."""
    import threading
    import time

    from moe_onnx.custom_ops import spin

    inside = np.ones(1, np.int64)
    left_at: list[float] = []

    def leave():
        time.sleep(0.05)
        left_at.append(time.perf_counter())
        inside[0] = 0

    helper = threading.Thread(target=leave)
    helper.start()
    spin.wait_until_zero(inside.ctypes.data, 100)
    returned_at = time.perf_counter()
    helper.join()
    assert inside[0] == 0 and left_at and returned_at >= left_at[0]


_TINY_LAYER_RUN = """
import numpy as np
import moe_onnx
from moe_onnx.benchmarks.bench_layer_e2e import layer_model, layer_tokens, layer_weights
from moe_onnx.benchmarks.presets import LAYER_SHAPES
from moe_onnx.custom_ops import expert_chain, parallel

parallel._cpu_count = lambda: 2
shape = LAYER_SHAPES["tiny"]
session = moe_onnx.InferenceSession(layer_model(shape))
feeds = {**layer_tokens(shape, 1), **layer_weights(shape)}
first = session.run(None, feeds)[0]
real = expert_chain.dispatch_experts_and_combine
done = []
expert_chain.dispatch_experts_and_combine = lambda *a, **k: done.append(real(*a, **k)) or done[-1]
second = session.run(None, feeds)[0]
print(len(done), done[0] is not None and done[0].chain is not None, np.array_equal(first, second))
"""


def test_a_layer_too_small_to_split_runs_the_chain_in_a_fresh_process():
    """The tiny layer (no product large enough for the helpers) in a process where no compiled
    call ran before: the chain registers the helpers' compiled server itself and computes the
    layer (it declined every call when nothing had registered it)."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-c", _TINY_LAYER_RUN], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["1", "True", "True"]


def test_read_only_ids_and_scales_take_the_chain(two_workers, taken):
    """Read-only ids and probabilities (initializers, read-only feeds) give the same bits as
    writable ones: the compiled function writes both only when it gates, but numba types
    read-only arrays apart and would refuse to compile it."""
    dtype, k = np.dtype(np.float32), 2
    session = moe_onnx.InferenceSession(dispatch_model(k, dtype))
    feeds = feeds_of(3, dtype)
    del feeds["logits"]
    feeds |= {"ids": np.array([[0, 1], [2, 1], [3, 0]], np.int32), "probs": np.full((3, k), 0.5, np.float32)}
    want = session.run(None, feeds)
    for name in ("ids", "probs"):
        feeds[name].flags.writeable = False
    got = session.run(None, feeds)
    assert taken == ["dispatch + chain"]
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)


def test_initializer_weights_take_the_chain(two_workers, taken):
    """Weights stored in the model (read-only arrays once loaded), as in an exported model: the
    chain computes the layer with the bits of the ops run one by one."""
    from onnx import numpy_helper

    dtype, k = np.dtype(np.float32), 2
    model, names = layer_model(k, dtype)
    feeds = feeds_of(2, dtype)
    weights = {name: feeds.pop(name) for name in ("w13", "w2")}
    model.graph.initializer.extend(numpy_helper.from_array(value, name) for name, value in weights.items())
    kept = [i for i in model.graph.input if i.name not in weights]
    del model.graph.input[:]
    model.graph.input.extend(kept)
    session = moe_onnx.InferenceSession(model)
    session.run(None, feeds)
    got = dict(zip(names, session.run(None, feeds), strict=True))
    want = one_by_one(feeds | weights, k, 2, 1)
    assert taken == ["gating + dispatch + chain"]
    for name in names:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
