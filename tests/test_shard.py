"""`moe-onnx shard` / shard_experts: each rank of the sharded model gives the single-device
model's output on that rank's batch, holds only its experts' weights, and runs lowered and
under MPI; what cannot be sharded is refused by name."""

from __future__ import annotations

import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from moe_onnx import InferenceSession
from moe_onnx.commands.cli import main
from moe_onnx.converters import NotShardable, lower, shard_experts
from moe_onnx.models.moe_model import DTYPES, MoeModelConfig, build_moe_model, layer_weights
from moe_onnx.ranks import RankFailure, ThreadRanks
from tests.support import one_product_path

#: E = 32 experts: top-8 of one rank's experts fits on 4 ranks (L = 8)
EXPERTS, HIDDEN, FFN = 32, 40, 8


def config(top_k: int, shared: bool, dtype: str, **kw) -> MoeModelConfig:
    return MoeModelConfig(
        layers=2, experts=EXPERTS, top_k=top_k, hidden=HIDDEN, ffn=FFN, shared_experts=shared, dtype=dtype, **kw
    )


def batches(cfg: MoeModelConfig, ranks: int, seed: int = 0) -> tuple[list[np.ndarray], int, int]:
    """One batch per rank, of different sizes: one rank has 0 tokens (rank 0 of 2, rank 1 of 4), and every token of the
    last rank picks (in layer 0) only experts of rank 0. Returns (batches, crafted rank, its target)."""
    rng = np.random.default_rng(seed)
    dtype = DTYPES[cfg.dtype][0]
    sizes = {2: [0, 9], 4: [6, 0, 9, 5]}[ranks]
    xs = [rng.standard_normal((t, cfg.hidden)).astype(np.float32) for t in sizes]
    crafted, target, local = ranks - 1, 0, cfg.experts // ranks
    # logits x @ router = big on rank 0's experts (distinct values, so top-k is unambiguous)
    router = layer_weights(cfg, 0)["router"].astype(np.float32)
    logits = np.full((sizes[crafted], cfg.experts), -6.0, np.float32)
    logits[:, target * local : (target + 1) * local] = 6.0 + rng.permuted(
        np.tile(np.arange(local), (sizes[crafted], 1)), axis=1
    )
    xs[crafted] = logits @ np.linalg.pinv(router)
    xs = [x.astype(dtype) for x in xs]
    chosen = np.argsort(-(xs[crafted].astype(np.float32) @ router), axis=1, kind="stable")[:, : cfg.top_k]
    assert (chosen // local == target).all(), "the crafted batch must route only to rank 0's experts"
    return xs, crafted, target


def single_device(model: onnx.ModelProto, xs: list[np.ndarray]) -> list[np.ndarray]:
    session = InferenceSession(model)
    return [session.run(None, {"x": x})[0] for x in xs]


#: the largest difference allowed between a rank's float32 output and the single device's,
#: relative to its largest value, where their rows' sums take other orders: about 100
#: roundings of float32 (a wrong expert or scale is off by O(1))
SHARD_RELATIVE_ERROR = 1e-5


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    got, want = got.astype(np.float64), want.astype(np.float64)
    if want.size == 0:
        return 0.0
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def run_ranks(models, xs, executor: str = "split") -> list[np.ndarray]:
    ranks = ThreadRanks(models, timeout=120, executor=executor)
    return [out[0] for out in ranks.run([{"x": x} for x in xs])]


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("top_k", [1, 2, 8])
def test_each_rank_gives_the_single_device_output(top_k, shared, dtype, ranks):
    cfg = config(top_k, shared, dtype)
    model = build_moe_model(cfg)
    xs, _, _ = batches(cfg, ranks)
    shards, report = shard_experts(model, ranks)
    assert len(shards) == ranks and [layer.local_experts for layer in report.layers] == [EXPERTS // ranks] * 2
    got = run_ranks(shards, xs)
    for rank, (y, want) in enumerate(zip(got, single_device(model, xs))):
        assert y.dtype == want.dtype and y.shape == want.shape == xs[rank].shape
        # an expert's group has other rows on its rank (every rank's tokens) than on the single
        # device (this rank's), and GroupedMatmul multiplies groups of a few rows with its
        # fixed-order kernel, bigger ones with BLAS: a row may take the other path, so the
        # last bits may differ (docs/expert-parallelism.md); how far depends on BLAS's kernels:
        # up to 1.3e-6 where OpenBLAS runs its Haswell kernels (a Zen 5), 1e-6 elsewhere
        assert relative_error(y, want) <= SHARD_RELATIVE_ERROR, f"rank {rank}"
    with one_product_path():
        # every group through the one kernel on both sides: a row's bits depend on its own
        # values only, not on which rows share its expert, so the outputs are bit-identical
        for rank, (y, want) in enumerate(zip(run_ranks(shards, xs), single_device(model, xs))):
            np.testing.assert_array_equal(y.view(np.uint8), want.view(np.uint8), err_msg=f"rank {rank}")


def test_single_device_model_is_the_moe_it_describes():
    """The test model itself, against float64 numpy written from its module doc."""
    cfg = config(2, True, "float32")
    x = np.random.default_rng(5).standard_normal((7, HIDDEN)).astype(np.float32)
    h = x.astype(np.float64)
    for layer in range(cfg.layers):
        w = {k: v.astype(np.float64) for k, v in layer_weights(cfg, layer).items()}
        logits = h @ w["router"]
        probs = np.exp(logits - logits.max(1, keepdims=True))
        probs /= probs.sum(1, keepdims=True)
        top = np.argsort(-probs, axis=1, kind="stable")[:, : cfg.top_k]

        def swiglu(a):
            gate, up = np.split(a, 2, axis=-1)
            return gate / (1 + np.exp(-gate)) * up

        out = h + swiglu(h @ w["shared_up"]) @ w["shared_down"]
        for t in range(len(h)):
            for e in top[t]:
                out[t] += probs[t, e] * (swiglu(h[t] @ w["w13"][e]) @ w["w2"][e])
        h = out
    np.testing.assert_allclose(single_device(build_moe_model(cfg), [x])[0], h, rtol=1e-4, atol=1e-5)


def test_cumsum_counts_and_lowered_shards():
    """Counts given as a cumsum (group_list_type 0) shard too; the lowered shards (onnxruntime
    runs the ops' standard-ONNX bodies, the collectives stay kernels) give the same output."""
    cfg = config(2, True, "float32", counts="cumsum")
    model = build_moe_model(cfg)
    xs, _, _ = batches(cfg, 4)
    shards, _ = shard_experts(model, 4)
    want = single_device(model, xs)
    for y, w in zip(run_ranks(shards, xs), want):
        assert relative_error(y, w) <= SHARD_RELATIVE_ERROR  # other group sizes (see test_each_rank_gives_...)
    with one_product_path():
        for y, w in zip(run_ranks(shards, xs), single_device(model, xs)):
            np.testing.assert_array_equal(y, w)
    for name, models, executor in (
        ("functions", [lower(shard) for shard in shards], "split"),
        ("inlined", shards, "lowered"),
    ):
        for rank, (y, w) in enumerate(zip(run_ranks(models, xs, executor=executor), want)):
            assert relative_error(y, w) <= SHARD_RELATIVE_ERROR, f"lowered ({name}) rank {rank}"


def initializer_bytes(path) -> dict[str, int]:
    model = onnx.load(str(path))
    return {t.name: onnx.numpy_helper.to_array(t).nbytes for t in model.graph.initializer}


@pytest.mark.parametrize("ranks", [2, 4])
def test_command_writes_each_rank_only_its_weights(tmp_path, ranks, capsys):
    cfg = config(2, True, "bfloat16")
    onnx.save(build_moe_model(cfg), tmp_path / "model.onnx")
    assert main(["shard", str(tmp_path / "model.onnx"), str(tmp_path / "out"), "--ranks", str(ranks)]) == 0
    assert f"over {ranks} ranks" in capsys.readouterr().out
    weights = [layer_weights(cfg, layer) for layer in range(cfg.layers)]
    expert = sum(w[k].nbytes for w in weights for k in ("w13", "w2"))
    other = sum(w[k].nbytes for w in weights for k in w if k not in ("w13", "w2"))
    for rank in range(ranks):
        path = tmp_path / "out" / f"rank{rank}.onnx"
        held = sum(initializer_bytes(path).values())
        assert abs(held - (other + expert / ranks)) <= 0.01 * (other + expert / ranks)
        data = os.path.getsize(tmp_path / "out" / f"rank{rank}.onnx.data")
        assert abs(data - held) <= 0.01 * held  # the weights live in the rank's own data file
        layer0 = onnx.numpy_helper.to_array(
            next(t for t in onnx.load(str(path)).graph.initializer if t.name == "layer0.w13")
        )
        local = EXPERTS // ranks
        np.testing.assert_array_equal(
            layer0.view(np.uint16), weights[0]["w13"][rank * local : (rank + 1) * local].view(np.uint16)
        )
    assert sorted(os.listdir(tmp_path / "out")) == sorted(
        f"rank{r}.onnx{suffix}" for r in range(ranks) for suffix in ("", ".data")
    )


def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    return subprocess.run(
        [sys.executable, "-m", "moe_onnx_command", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


@pytest.mark.parametrize("backend", ["threads", pytest.param("mpi", marks=pytest.mark.mpi)])
def test_run_command_on_the_shards(tmp_path, backend):
    """`moe-onnx shard` then `moe-onnx run OUT --backend B --inputs in/rank{r}.npz`, 4 ranks."""
    cfg = config(8, True, "float32")
    model = build_moe_model(cfg)
    onnx.save(model, tmp_path / "model.onnx")
    xs, _, _ = batches(cfg, 4, seed=1)
    (tmp_path / "in").mkdir()
    for rank, x in enumerate(xs):
        np.savez(tmp_path / "in" / f"rank{rank}.npz", x=x)
    done = cli("shard", str(tmp_path / "model.onnx"), str(tmp_path / "out"), "--ranks", "4")
    assert done.returncode == 0, done.stderr
    done = cli(
        "run",
        str(tmp_path / "out"),
        "--backend",
        backend,
        "--inputs",
        str(tmp_path / "in" / "rank{r}.npz"),
        "--outputs",
        str(tmp_path / "res"),
    )
    assert done.returncode == 0, done.stderr
    # the shards run in this process give the command's bits; the single-device model's groups
    # hold other rows, so its values agree to float32 rounding (see test_each_rank_gives_...)
    shards = [onnx.load(tmp_path / "out" / f"rank{rank}.onnx") for rank in range(4)]
    for rank, (y, want) in enumerate(zip(run_ranks(shards, xs), single_device(model, xs))):
        got = np.load(tmp_path / "res" / f"rank{rank}.npz")["y"]
        np.testing.assert_array_equal(got, y, err_msg=f"rank {rank}")
        assert relative_error(got, want) <= SHARD_RELATIVE_ERROR, f"rank {rank}"


# --- refusals -------------------------------------------------------------------------------


def test_experts_not_divisible_by_ranks_are_refused_by_name():
    model = build_moe_model(MoeModelConfig(experts=6))
    with pytest.raises(NotShardable, match=r"MoeInitRoutingV2 'layer0.routed_rows'.*E = 6 experts .* 4 ranks"):
        shard_experts(model, 4)


def test_command_refusals_are_one_line(tmp_path, capsys):
    onnx.save(build_moe_model(MoeModelConfig(experts=6)), tmp_path / "model.onnx")
    assert main(["shard", str(tmp_path / "model.onnx"), str(tmp_path / "out"), "--ranks", "4"]) == 2
    err = capsys.readouterr().err
    assert "NotShardable" in err and "E % N = 2" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists() or not os.listdir(tmp_path / "out")
    (tmp_path / "model.onnx").write_bytes(b"not a model")
    assert main(["shard", str(tmp_path / "model.onnx"), str(tmp_path / "out"), "--ranks", "2"]) == 2
    assert "is not an ONNX model" in capsys.readouterr().err


def _edit(model: onnx.ModelProto, node_name: str, edit) -> onnx.ModelProto:
    model = onnx.ModelProto.FromString(model.SerializeToString())
    node = next(n for n in model.graph.node if n.name == node_name)
    edit(model, node)
    return model


def _set(node: onnx.NodeProto, name: str, value) -> None:
    for attribute in node.attribute:
        if attribute.name == name:
            node.attribute.remove(attribute)
            break
    node.attribute.append(helper.make_attribute(name, value))


def _insert_after_first_gmm(op_type: str, extra_inputs: list[str], initializers=()):
    def edit(model, node):
        out = node.output[0]
        node.output[0] = out + "_raw"
        index = list(model.graph.node).index(node)
        model.graph.node.insert(index + 1, helper.make_node(op_type, [out + "_raw", *extra_inputs], [out], name="odd"))
        model.graph.initializer.extend(initializers)

    return edit


REFUSED = {
    "drop_pad": ("layer0.routed_rows", lambda m, n: _set(n, "drop_pad_mode", 1), "drop/pad routing"),
    "no_counts": (
        "layer0.routed_rows",
        lambda m, n: _set(n, "expert_tokens_count_or_cumsum_flag", 0),
        "no per-expert counts",
    ),
    "not_row_wise": (
        "layer0.experts_up",
        _insert_after_first_gmm("Transpose", []),
        "is not GroupedMatmul, SwiGlu or a row-wise elementwise op",
    ),
    "rows_operand": (
        "layer1.experts_up",
        _insert_after_first_gmm(
            "Add", ["row_bias"], [onnx.numpy_helper.from_array(np.ones((3, 1), np.float32), "row_bias")]
        ),
        "neither the experts' rows nor a constant with no rows",
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_unshardable_layers_are_refused_by_name(case):
    node_name, edit, fragment = REFUSED[case]
    model = _edit(build_moe_model(MoeModelConfig()), node_name, edit)
    with pytest.raises(NotShardable, match=fragment) as refused:
        shard_experts(model, 2)
    assert "'" in str(refused.value)  # names the node


def test_weights_that_are_inputs_and_models_with_collectives_are_refused():
    model = build_moe_model(MoeModelConfig())
    weight = next(t for t in model.graph.initializer if t.name == "layer0.w13")
    model.graph.input.append(helper.make_tensor_value_info(weight.name, TensorProto.FLOAT, list(weight.dims)))
    model.graph.initializer.remove(weight)
    with pytest.raises(NotShardable, match="weight is not a constant"):
        shard_experts(model, 2)
    shards, _ = shard_experts(build_moe_model(MoeModelConfig()), 2)
    with pytest.raises(NotShardable, match="already holds collectives"):
        shard_experts(shards[0], 2)


def test_a_rank_failing_names_it():
    """A wrong feed on one rank fails every rank with a clear error, not a hang."""
    cfg = config(2, False, "float32")
    shards, _ = shard_experts(build_moe_model(cfg), 2)
    with pytest.raises(RankFailure):
        run_ranks(shards, [np.zeros((3, HIDDEN), np.float32), np.zeros((3, HIDDEN + 1), np.float32)])


def test_bfloat16_is_carried_as_bfloat16():
    shards, _ = shard_experts(build_moe_model(config(1, False, "bfloat16")), 2)
    w13 = next(t for t in shards[1].graph.initializer if t.name == "layer0.w13")
    assert w13.data_type == TensorProto.BFLOAT16 and list(w13.dims)[0] == EXPERTS // 2
    assert ml_dtypes.bfloat16  # the dtype the test batches use


@pytest.mark.mpi
def test_bfloat16_shards_under_mpi(tmp_path):
    """Two bfloat16 models (top-1 without, top-2 with a shared expert), 2 MPI ranks, in one job:
    rank 0 has no tokens, rank 1's all go to rank 0's experts."""
    cases = {}
    for top_k, shared in ((1, False), (2, True)):
        cfg = config(top_k, shared, "bfloat16")
        model = build_moe_model(cfg)
        xs, _, _ = batches(cfg, 2, seed=top_k)
        folder = tmp_path / f"top{top_k}"
        folder.mkdir()
        for rank, shard in enumerate(shard_experts(model, 2)[0]):
            onnx.save(shard, folder / f"rank{rank}.onnx")
            np.savez(folder / f"in{rank}.npz", x=xs[rank].view(np.uint16))
        cases[folder] = single_device(model, xs)
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    job = os.path.join(os.path.dirname(__file__), "mpi_shard_job.py")
    command = ["mpiexec", "--oversubscribe", "-n", "2", sys.executable, job, *map(str, cases)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    for folder, wants in cases.items():
        for rank, want in enumerate(wants):
            np.testing.assert_array_equal(np.load(folder / f"out{rank}.npy"), want.view(np.uint16))


def test_shard_help_prints(capsys):
    with pytest.raises(SystemExit) as done:
        main(["shard", "--help"])
    assert done.value.code == 0 and "E % N must be 0" in capsys.readouterr().out


def _with_bias_and_transposed_weight(model, node):
    """layer0's first expert product gets a bias [E, 2F] and reads its weight through a
    Transpose of a stored [E, 2F, H] (as a transposed checkpoint exports)."""
    weight = next(t for t in model.graph.initializer if t.name == node.input[1])
    stored = onnx.numpy_helper.to_array(weight).transpose(0, 2, 1).copy()
    model.graph.initializer.remove(weight)
    model.graph.initializer.append(onnx.numpy_helper.from_array(stored, "w13_stored"))
    bias = np.random.default_rng(3).standard_normal((stored.shape[0], stored.shape[1])).astype(np.float32)
    model.graph.initializer.append(onnx.numpy_helper.from_array(bias, "w13_bias"))
    index = list(model.graph.node).index(node)
    model.graph.node.insert(index, helper.make_node("Transpose", ["w13_stored"], ["w13_view"], perm=[0, 2, 1]))
    node.input[1], node.input[2] = "w13_view", "w13_bias"


def test_bias_and_transposed_weights_are_sliced():
    cfg = config(2, False, "float32")
    model = _edit(build_moe_model(cfg), "layer0.experts_up", _with_bias_and_transposed_weight)
    xs, _, _ = batches(cfg, 4)
    shards, report = shard_experts(model, 4)
    held = {t.name: list(t.dims) for t in shards[2].graph.initializer}
    assert held["w13_stored"][0] == held["w13_bias"][0] == EXPERTS // 4
    for rank, (y, want) in enumerate(zip(run_ranks(shards, xs), single_device(model, xs))):
        # other group sizes, other product paths (see test_each_rank_gives_...); the crafted
        # batch's large rows cancel in the sums here: 1.07e-6 measured where OpenBLAS ran its
        # AVX-512 kernels, 2.9e-6 where its Haswell ones (a Zen 5)
        assert relative_error(y, want) <= SHARD_RELATIVE_ERROR, f"rank {rank}"
    with one_product_path():
        for rank, (y, want) in enumerate(zip(run_ranks(shards, xs), single_device(model, xs))):
            np.testing.assert_array_equal(y, want, err_msg=f"rank {rank}")


def test_layers_without_node_names_shard():
    """Exporters may leave nodes unnamed: the new nodes of each layer still get their own names."""
    model = build_moe_model(config(2, True, "float32"))
    for node in model.graph.node:
        node.name = ""
    xs, _, _ = batches(config(2, True, "float32"), 2)
    shards, _ = shard_experts(model, 2)
    for y, want in zip(run_ranks(shards, xs), single_device(model, xs)):
        np.testing.assert_array_equal(y, want)
