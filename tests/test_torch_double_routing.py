"""Done-when of issue 21 in CI: cann-recipes-infer's call patterns (tests/moe_chain.py, an
expert-parallel prefill written with torch_npu's names after install_stand_ins) run on 2 gloo
ranks against a dense pure-torch MoE, float32 and bfloat16; the same chain with moe_onnx.torch
exports one model per rank with a dynamic token count, and ``moe-onnx run --ranks 2`` (threads;
MPI under ``-m mpi``) gives eager's outputs for the example batch and two other sizes.
(cann-recipes-infer's own files run in tests/test_cann_recipes_peers.py, ``-m peers``.)"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import onnx
import pytest

from moe_onnx.commands import cli
from tests.moe_chain import Config, export_ranks, worker
from tests.torch_ranks import start_ranks

#: relative error (max |got - want| / max |want|) against the dense float32 reference
TOLERANCE = {"float32": 2e-5, "bfloat16": 4e-2}
EXPORT_TOLERANCE = dict(rtol=1e-5, atol=1e-5)
CONFIG = Config(ranks=2)
INPUTS = ("x", "topk_ids", "topk_weight", "shared")


@pytest.fixture(scope="module")
def chain_run(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("chain")
    start_ranks(worker, CONFIG.ranks, CONFIG, str(out_dir), directory=str(out_dir))
    export_ranks(CONFIG, str(out_dir))
    return out_dir


def test_ascend_call_patterns_match_the_dense_moe(chain_run):
    for rank in range(CONFIG.ranks):
        with np.load(chain_run / f"errors{rank}.npz") as saved:
            errors = {name: float(saved[name]) for name in saved.files}
        for tokens in CONFIG.batches:
            for dtype, tolerance in TOLERANCE.items():
                for chain in ("ascend", "moe_onnx"):
                    assert errors[f"{chain}_{dtype}_{tokens}"] <= tolerance, (rank, chain, dtype, tokens, errors)
                assert errors[f"ascend_{dtype}_{tokens}_dtype_ok"] == 1.0


def test_exports_have_our_nodes_and_a_dynamic_token_count(chain_run):
    model = onnx.load(chain_run / "rank0.onnx")
    assert all(i.type.tensor_type.shape.dim[0].dim_param for i in model.graph.input), (
        "token count exported as a constant"
    )
    ops = [n.op_type for n in model.graph.node if n.domain == "cann.moe"]
    for op_type in ("MoeInitRoutingV2", "AllGather", "AllToAll", "MoeReRoutingV2", "GroupedMatmul", "SwiGlu"):
        assert op_type in ops, ops
    assert ops.count("GroupedMatmul") == 2 and ops[-1] == "MoeFinalizeRoutingV2", ops


def write_inputs(out_dir, tokens):
    for rank in range(CONFIG.ranks):
        with np.load(out_dir / f"rank{rank}_T{tokens}.npz") as saved:
            np.savez(out_dir / f"in{rank}_T{tokens}.npz", **{name: saved[name] for name in INPUTS})
    return str(out_dir / f"in{{r}}_T{tokens}.npz")


def check_outputs(out_dir, result_dir, tokens):
    (output,) = onnx.load(out_dir / "rank0.onnx", load_external_data=False).graph.output
    for rank in range(CONFIG.ranks):
        with np.load(result_dir / f"rank{rank}.npz") as got, np.load(out_dir / f"rank{rank}_T{tokens}.npz") as eager:
            np.testing.assert_allclose(got[output.name], eager["y"], **EXPORT_TOLERANCE)


def test_moe_onnx_run_threads_matches_eager(chain_run):
    for tokens in CONFIG.batches:
        inputs = write_inputs(chain_run, tokens)
        result_dir = chain_run / f"threads_T{tokens}"
        code = cli.main(["run", str(chain_run), "--ranks", "2", "--inputs", inputs, "--outputs", str(result_dir)])
        assert code == 0
        check_outputs(chain_run, result_dir, tokens)


@pytest.mark.mpi
@pytest.mark.slow  # each launch costs seconds: CI's second step
def test_moe_onnx_run_mpi_matches_eager(chain_run):
    for tokens in CONFIG.batches:
        inputs = write_inputs(chain_run, tokens)
        result_dir = chain_run / f"mpi_T{tokens}"
        result = subprocess.run(
            [sys.executable, "-m", "moe_onnx.commands.cli", "run", str(chain_run), "--ranks", "2", "--backend", "mpi"]
            + ["--inputs", inputs, "--outputs", str(result_dir)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert result.returncode == 0, result.stdout + result.stderr
        check_outputs(chain_run, result_dir, tokens)
