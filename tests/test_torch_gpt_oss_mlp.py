"""Done-when of issue 22 in CI: cann-recipes-infer's gpt-oss MoE MLP call pattern
(tests/gpt_oss_mlp.py: softmax top-k gating -> v1 init routing -> expert-token cumsum ->
grouped matmul with float32 bias -> clamped SwiGLU -> grouped matmul -> finalize routing with
expert ids), written with torch_npu's names after install_stand_ins(), against a dense
pure-torch MoE in float32 and bfloat16; exported with a dynamic token count (gpt-oss's v1
``active_num=token_count``), it runs like eager in moe_onnx and, lowered, in stock onnxruntime.
(The recipe's own file runs in tests/test_cann_recipes_gpt_oss_peers.py, ``-m peers``.)"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime
import pytest
import torch

import moe_onnx
import moe_onnx.torch as mt
from tests.gpt_oss_mlp import GptOssMlpPattern, MlpConfig, dense_reference, mlp_weights, relative_error, tokens

#: relative error (max |got - want| / max |want|) against the dense float32 reference
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 4e-2}
CONFIG = MlpConfig()


@pytest.fixture(scope="module", autouse=True)
def stand_ins():
    mt.install_stand_ins()


@pytest.mark.parametrize("dtype", TOLERANCE, ids=["float32", "bfloat16"])
def test_gpt_oss_call_pattern_matches_the_dense_moe(dtype):
    mlp = GptOssMlpPattern(CONFIG, mlp_weights(CONFIG), dtype)
    held = mlp.held()
    assert held["experts.gate_up_proj"].dtype == dtype and held["experts.gate_up_proj_bias"].dtype == torch.float32
    for count in CONFIG.batches:
        x = tokens(CONFIG, count).to(dtype)
        y = mlp(x)
        assert y.dtype == dtype and y.shape == x.shape
        logits = x @ held["router.weight"].T + held["router.bias"]  # the router, as the model computes it
        assert relative_error(y, dense_reference(x, logits, held, CONFIG.top_k)) <= TOLERANCE[dtype], (dtype, count)


def test_the_reference_reaches_the_clamp_and_routes_differently_per_token():
    """The weights exercise gpt-oss's clamp, and the tokens do not all pick the same experts
    (so a wrong routing could not pass unnoticed)."""
    weights = mlp_weights(CONFIG)
    x = tokens(CONFIG, CONFIG.batches[-1])
    gate_up = torch.einsum("th,ehf->etf", x, weights["experts.gate_up_proj"])
    gate_up += weights["experts.gate_up_proj_bias"][:, None]
    assert (gate_up[..., ::2] > 7.0).any() and (gate_up[..., 1::2].abs() > 7.0).any()
    logits = x @ weights["router.weight"].T + weights["router.bias"]
    assert len({tuple(sorted(row)) for row in logits.topk(CONFIG.top_k).indices.tolist()}) > 3


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt_oss") / "mlp.onnx"
    mlp = GptOssMlpPattern(CONFIG, mlp_weights(CONFIG)).eval()
    with torch.no_grad():
        mt.export(mlp, (tokens(CONFIG, CONFIG.batches[0]),), path, dynamic_shapes=({0: torch.export.Dim("T")},))
    return mlp, path


def test_export_has_a_dynamic_token_count_and_every_op_of_the_chain(exported):
    _, path = exported
    model = onnx.load(path)
    assert model.graph.input[0].type.tensor_type.shape.dim[0].dim_param, "token count exported as a constant"
    ops = [n.op_type for n in model.graph.node if n.domain == moe_onnx.DOMAIN]
    assert ops == [
        "MoeGatingTopKSoftmax",
        "MoeInitRouting",
        "MoeComputeExpertTokens",
        "GroupedMatmul",
        "GroupedMatmul",
        "MoeFinalizeRoutingV2",
    ], ops


def test_exported_mlp_runs_like_eager_in_moe_onnx_and_lowered_in_stock_onnxruntime(exported):
    mlp, path = exported
    ours = moe_onnx.InferenceSession(str(path))
    stock = onnxruntime.InferenceSession(moe_onnx.lower(onnx.load(path)).SerializeToString())
    name = stock.get_inputs()[0].name
    for count in CONFIG.batches:
        x = tokens(CONFIG, count, seed=2)
        with torch.no_grad():
            want = mlp(x).numpy()
        for session in (ours, stock):
            (got,) = session.run(None, {name: x.numpy()})
            assert got.shape == want.shape
            # the router's MatMul and the clamped SwiGLU run in onnxruntime: a few ulps apart
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))
