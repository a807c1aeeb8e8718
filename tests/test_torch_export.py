"""moe_onnx.torch.export and the translation table: our ops, stable sorts in torch's exact
order, remainder by a dynamic size; the exported model runs in moe_onnx.InferenceSession
like eager at batch sizes other than the example's."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

import moe_onnx
import moe_onnx.torch as mt
from moe_onnx.torch.translations import translation_table

T = torch.export.Dim("T")


class Routing(torch.nn.Module):
    """Top-2 routing, permute with MoeInitRoutingV2, rows regrouped with MoeReRouting as if
    from 2 ranks, scaled, unpermuted; plus the ops torch code uses around such layers."""

    def forward(self, x, scores):
        probs, experts = torch.topk(scores.softmax(-1), 2)
        routing_map = torch.zeros_like(scores, dtype=torch.bool).scatter(1, experts, True)
        weights = torch.zeros_like(scores).scatter(1, experts, probs)
        expanded, row_idx, counts, _ = mt.moe_init_routing_v2(
            x, experts.to(torch.int32), expert_num=4, expert_tokens_count_or_cumsum_flag=2
        )
        rows, _, gather, _ = mt.moe_re_routing(expanded, counts.view(2, 2))
        back = (rows * 3).index_select(0, torch.argsort(gather.to(torch.int64), stable=True))
        y, *_ = mt.moe_token_unpermute_with_routing_map(back, row_idx, routing_map, weights)
        flat = experts.reshape(-1)
        values, order = torch.sort(flat, stable=True, descending=True)
        ranks = torch.arange(flat.shape[0]) % x.shape[0]  # remainder by the dynamic token count
        return y, values, order, torch.argsort(x.round(), dim=1, stable=True), ranks, x.round() % x.shape[0]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    path = tmp_path_factory.mktemp("export") / "routing.onnx"
    example = (torch.randn(6, 5), torch.randn(6, 4))
    mt.export(Routing(), example, path, dynamic_shapes=({0: T}, {0: T}))
    return path


@pytest.mark.parametrize("tokens", [6, 3, 11])
def test_exported_model_matches_eager_at_every_batch_size(exported, tokens):
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 5, generator=g) * 3
    scores = torch.randn(tokens, 4, generator=g)  # no ties: torch.topk's order among ties is unspecified
    got = moe_onnx.InferenceSession(str(exported)).run(None, {"x": x.numpy(), "scores": scores.numpy()})
    want = Routing()(x, scores)
    np.testing.assert_allclose(got[0], want[0].numpy(), rtol=1e-6, atol=1e-6)  # onnxruntime's softmax: ulps
    for name, a, b in zip(("values", "order", "argsort", "ranks", "remainder"), got[1:], want[1:]):
        np.testing.assert_array_equal(a, b.numpy(), err_msg=name)


def test_exported_model_has_our_nodes_and_a_dynamic_token_count(exported):
    model = onnx.load(exported)
    assert model.graph.input[0].type.tensor_type.shape.dim[0].dim_param
    ours = [n.op_type for n in model.graph.node if n.domain == moe_onnx.DOMAIN]
    assert ours == ["MoeInitRoutingV2", "MoeReRouting", "MoeTokenUnpermuteWithRoutingMap"]
    assert {(o.domain, o.version) for o in model.opset_import} >= {(moe_onnx.DOMAIN, 1)}


def test_stable_sort_translation_keeps_torch_order(tmp_path):
    """int32, int64, float32 and bool keys with many ties, ascending along dim 0 and
    descending along dim 1, at the exported length and others."""

    class Sort(torch.nn.Module):
        def forward(self, int32, int64, float32, boolean):
            outputs = []
            for x in (int32, int64, float32, boolean):
                outputs += [*torch.sort(x, dim=0, stable=True), torch.argsort(x, dim=1, stable=True, descending=True)]
            return tuple(outputs)

    dtypes = (torch.int32, torch.int64, torch.float32, torch.bool)
    g = torch.Generator().manual_seed(0)

    def keys(rows):
        return tuple(torch.randint(-3, 3, (rows, 3), generator=g).to(dtype) for dtype in dtypes)

    mt.export(Sort(), keys(40), tmp_path / "sort.onnx", dynamic_shapes=tuple({0: T} for _ in dtypes))
    session = moe_onnx.InferenceSession(str(tmp_path / "sort.onnx"))
    for rows in (40, 257):
        inputs = keys(rows)
        feeds = {i.name: x.numpy() for i, x in zip(session.get_inputs(), inputs)}
        for got, want in zip(session.run(None, feeds), Sort()(*inputs)):
            np.testing.assert_array_equal(got, want.numpy())


def test_translation_table_covers_every_op_and_torch_collectives():
    table = translation_table()
    assert set(mt.OVERLOADS.values()) <= set(table)
    for op in ("all_to_all_single", "all_gather_into_tensor", "wait_tensor"):
        assert getattr(torch.ops._c10d_functional, op).default in table
    assert torch.ops.aten.sort.stable in table and torch.ops.aten.argsort.stable in table


def test_readme_example_runs(tmp_path):
    """The "Exporting from PyTorch" example in the README, as written, in a fresh process: and
    quietly (issue 32: torch's exporter said "torchvision is not installed" four times)."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    readme = (Path(__file__).parents[1] / "README.md").read_text()
    section = readme[readme.index("## Exporting from PyTorch") :]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert (done.stdout, done.stderr) == ("", "")
    assert (tmp_path / "top2.onnx").exists()


def test_absent_middle_output_exports_as_a_computed_unread_output(tmp_path):
    """MoeInitRoutingV2 with only the before-capacity counts: ONNX names every output up to the
    last present one, so the node computes the counts too (flag 2); nothing reads them."""

    class BeforeCapacity(torch.nn.Module):
        def forward(self, x, expert_idx):
            expanded, _, counts, before = mt.moe_init_routing_v2(
                x, expert_idx, expert_num=3, drop_pad_mode=1, expert_capacity=2, expert_tokens_before_capacity_flag=1
            )
            assert counts is None
            return expanded, before

    x, expert_idx = torch.randn(4, 2), torch.tensor([[0, 1], [1, 2], [1, 0], [2, 1]], dtype=torch.int32)
    mt.export(BeforeCapacity(), (x, expert_idx), tmp_path / "before.onnx")
    (node,) = [n for n in onnx.load(tmp_path / "before.onnx").graph.node if n.domain == moe_onnx.DOMAIN]
    assert len(node.output) == 4 and {a.name: a.i for a in node.attribute}["expert_tokens_count_or_cumsum_flag"] == 2
    got = moe_onnx.InferenceSession(str(tmp_path / "before.onnx")).run(
        None, {"x": x.numpy(), "expert_idx": expert_idx.numpy()}
    )
    for a, b in zip(got, BeforeCapacity()(x, expert_idx)):
        np.testing.assert_array_equal(a, b.numpy())
