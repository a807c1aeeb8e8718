"""Done-when of the torch frontend: a Megatron-style EP MoE layer written with moe_onnx.torch
runs eagerly on 2 and 4 gloo processes, trains like the pure-torch reference, exports one
model per rank with a dynamic token count, and ``moe-onnx run`` (threads and MPI) on the
exports matches eager for the example batch and two other batch sizes; so do its legacy
(TorchScript) exports on threads."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from moe_onnx.commands import cli
from tests.torch_ep_layer import Config, export_ranks, worker
from tests.torch_ranks import start_ranks

# gloo ranks, training steps, exports and MPI runs: ~30 s; CI runs it with -m slow
pytestmark = pytest.mark.slow

#: relative error (max |got - want| / max |want|) of outputs and gradients vs the reference
FLOAT32_GRADIENT = 1e-6
#: exported model on onnxruntime vs eager torch
EXPORT_TOLERANCE = dict(rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def ep_run(request, tmp_path_factory):
    """Run the layer on N gloo processes; returns (config, directory of their results)."""
    config = Config(ranks=request.param)
    out_dir = tmp_path_factory.mktemp(f"ep{config.ranks}")
    start_ranks(worker, config.ranks, config, str(out_dir), directory=str(out_dir))
    export_ranks(config, str(out_dir))
    return config, out_dir


def test_eager_output_and_gradients_match_pure_torch_reference(ep_run):
    config, out_dir = ep_run
    for rank in range(config.ranks):
        with np.load(out_dir / f"errors{rank}.npz") as errors:
            wanted = {f"grad_{p}_{t}" for p in ("x", "router", "w_in", "w_out") for t in config.batches}
            assert set(errors.files) >= wanted
            worst = {name: float(errors[name]) for name in errors.files}
        assert max(worst.values()) <= FLOAT32_GRADIENT, {k: v for k, v in worst.items() if v > FLOAT32_GRADIENT}


def feeds_and_eager(config, out_dir, tokens):
    feeds, eager = [], []
    for rank in range(config.ranks):
        with np.load(out_dir / f"rank{rank}_T{tokens}.npz") as saved:
            feeds.append(saved["x"])
            eager.append(saved["y"])
    return feeds, eager


def write_inputs(out_dir, feeds, tokens):
    for rank, x in enumerate(feeds):
        np.savez(out_dir / f"in{rank}_T{tokens}.npz", x=x)
    return str(out_dir / f"in{{r}}_T{tokens}.npz")


def output_name(path):
    import onnx

    (output,) = onnx.load(path, load_external_data=False).graph.output
    return output.name


def check_outputs(config, out_dir, result_dir, eager):
    name = output_name(out_dir / "rank0.onnx")
    for rank in range(config.ranks):
        with np.load(result_dir / f"rank{rank}.npz") as got:
            np.testing.assert_allclose(got[name], eager[rank], **EXPORT_TOLERANCE)


def test_exports_have_a_dynamic_token_count(ep_run):
    import onnx

    config, out_dir = ep_run
    model = onnx.load(out_dir / "rank0.onnx")
    (x,) = model.graph.input
    assert x.type.tensor_type.shape.dim[0].dim_param, "token count exported as a constant"
    ops = {(n.domain, n.op_type) for n in model.graph.node}
    for op_type in ("MoeInitRoutingV2", "AllGather", "AllToAll", "MoeReRoutingV2", "MoeTokenUnpermuteWithRoutingMap"):
        assert ("cann.moe", op_type) in ops


def test_moe_onnx_run_threads_matches_eager(ep_run):
    """``moe-onnx run --backend threads`` (in process) on the eager batch and two other sizes."""
    config, out_dir = ep_run
    for tokens in config.batches:
        feeds, eager = feeds_and_eager(config, out_dir, tokens)
        inputs = write_inputs(out_dir, feeds, tokens)
        result_dir = out_dir / f"threads_T{tokens}"
        code = cli.main(
            ["run", str(out_dir), "--ranks", str(config.ranks), "--inputs", inputs, "--outputs", str(result_dir)]
        )
        assert code == 0
        check_outputs(config, out_dir, result_dir, eager)


def test_legacy_exports_run_like_eager_on_threads(ep_run):
    """The same layer exported by the legacy TorchScript exporter (register_legacy_symbolics), T
    dynamic: the eager batch and two other sizes on moe_onnx's thread ranks."""
    import onnx

    from moe_onnx.ranks import run_threads

    config, out_dir = ep_run
    models = [str(out_dir / "legacy" / f"rank{rank}.onnx") for rank in range(config.ranks)]
    model = onnx.load(models[0])
    assert model.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "T"
    ours = [n.op_type for n in model.graph.node if n.domain == "cann.moe"]
    assert ours == ["MoeInitRoutingV2", "AllGather", "AllToAll", "MoeReRoutingV2", "AllToAll"] + [
        "MoeTokenUnpermuteWithRoutingMap"
    ]
    for tokens in config.batches:
        feeds, eager = feeds_and_eager(config, out_dir, tokens)
        for rank, (y,) in enumerate(run_threads(models, [{"x": x} for x in feeds])):
            np.testing.assert_allclose(y, eager[rank], **EXPORT_TOLERANCE)


@pytest.mark.mpi
@pytest.mark.parametrize("ep_run", [2], indirect=True, ids=["2ranks"])  # each launch costs seconds
def test_moe_onnx_run_mpi_matches_eager(ep_run):
    """``moe-onnx run --backend mpi`` on the eager batch and two other sizes (2 ranks; the
    4-rank exports run on threads above, and test_ranks covers 4 MPI ranks)."""
    config, out_dir = ep_run
    for tokens in config.batches:
        feeds, eager = feeds_and_eager(config, out_dir, tokens)
        inputs = write_inputs(out_dir, feeds, tokens)
        result_dir = out_dir / f"mpi_T{tokens}"
        result = subprocess.run(
            [sys.executable, "-m", "moe_onnx.commands.cli", "run", str(out_dir), "--ranks", str(config.ranks)]
            + ["--backend", "mpi", "--inputs", inputs, "--outputs", str(result_dir)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert result.returncode == 0, result.stdout + result.stderr
        check_outputs(config, out_dir, result_dir, eager)
