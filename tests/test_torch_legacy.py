"""The legacy TorchScript exporter (``torch.onnx.export(dynamo=False)``) after
``moe_onnx.torch.register_legacy_symbolics()``: every op exports to its ``cann.moe`` node and runs
like the function, bit for bit; the collectives export on gloo ranks and run on moe_onnx's
thread ranks like eager at another row count; sorts keep torch's stable order."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
import torch

import moe_onnx
import moe_onnx.torch as mt
from moe_onnx.custom_ops import OPS, dtypes
from moe_onnx.ranks import run_threads
from moe_onnx.torch.arrays import to_numpy, to_torch
from moe_onnx.torch.schema import snake_case
from moe_onnx.torch.shapes import node_outputs
from tests.support import assert_same_bits
from tests.test_torch_ops import CASES
from tests.torch_ranks import start_ranks

#: torch's TorchScript exporter has no ONNX type for float8e8m0 (the dynamo exporter has)
E8M0_CASE = "fp8-e8m0-scales-cumsum"
LEGACY_CASES = [c for c in CASES if c[3] != E8M0_CASE]


@pytest.fixture(autouse=True, scope="module")
def symbolics():
    mt.register_legacy_symbolics()


def legacy_export(module, args, path, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the legacy exporter says it is legacy
        torch.onnx.export(module, args, path, dynamo=False, **kwargs)


class OneOp(torch.nn.Module):
    """``function(inputs..., **attrs)`` with the given inputs positional; the present outputs."""

    def __init__(self, op_type, given, attrs):
        super().__init__()
        self.function, self.op = getattr(mt, snake_case(op_type)), OPS[op_type]
        self.given, self.attrs = given, attrs

    def forward(self, *tensors):
        by_name = dict(zip(self.given, tensors))
        outputs = self.function(*[by_name.get(i.name) for i in self.op.inputs], **self.attrs)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        return tuple(out for out in outputs if out is not None)


@pytest.mark.parametrize(
    "op_type, inputs, attrs", [c[:3] for c in LEGACY_CASES], ids=[f"{c[0]}-{c[3]}" for c in LEGACY_CASES]
)
def test_every_op_exports_to_its_node_and_runs_like_the_function(tmp_path, op_type, inputs, attrs):
    op = OPS[op_type]
    given = [i.name for i in op.inputs if inputs.get(i.name) is not None]
    module, tensors = OneOp(op_type, given, attrs), tuple(to_torch(inputs[name]) for name in given)
    legacy_export(module, tensors, tmp_path / "op.onnx", input_names=given, opset_version=17)

    model = onnx.load(tmp_path / "op.onnx")
    onnx.checker.check_model(model, full_check=True)
    (node,) = [n for n in model.graph.node if n.domain == moe_onnx.DOMAIN]
    assert node.op_type == op_type
    input_dtypes = [None if inputs.get(i.name) is None else dtypes.name_of(inputs[i.name]) for i in op.inputs]
    assert len(node.output) == node_outputs(op, input_dtypes, attrs)[1]  # trailing absent outputs: not named
    for name, decl in zip(node.input, op.inputs):
        assert (name == "") == (inputs.get(decl.name) is None), f"{decl.name} named {name!r}"
    got = moe_onnx.InferenceSession(str(tmp_path / "op.onnx")).run(None, {name: inputs[name] for name in given})
    want = module(*tensors)
    assert len(got) == len(want)
    for index, (a, b) in enumerate(zip(got, want)):
        assert_same_bits(a, to_numpy(b), f"{op_type} output {index}")


def test_float8e8m0_is_refused_by_torchs_legacy_exporter(tmp_path):
    """The README's limit: torch's TorchScript exporter cannot type a float8e8m0 tensor."""
    op_type, inputs, attrs, _ = next(c for c in CASES if c[3] == E8M0_CASE)
    given = [i.name for i in OPS[op_type].inputs if inputs.get(i.name) is not None]
    tensors = tuple(to_torch(inputs[name]) for name in given)
    with pytest.raises(RuntimeError, match="Float8_e8m0fnu"):
        legacy_export(OneOp(op_type, given, attrs), tensors, tmp_path / "e8m0.onnx", opset_version=17)


class Sorts(torch.nn.Module):
    def forward(self, int32, int64, float32, boolean):
        outputs = []
        for x in (int32, int64, float32, boolean):
            outputs += [*torch.sort(x, dim=0, stable=True), torch.argsort(x, dim=1, stable=True, descending=True)]
            outputs.append(torch.argsort(x, dim=0))  # not stable: any order of ties is torch's too
        return tuple(outputs)


@pytest.mark.parametrize("opset", [11, 17])
def test_sorts_keep_torchs_stable_order(tmp_path, opset):
    """int32, int64, float32 and bool keys with many ties, at the traced length and another."""
    key_dtypes = (torch.int32, torch.int64, torch.float32, torch.bool)
    names = ["int32", "int64", "float32", "boolean"]
    g = torch.Generator().manual_seed(0)

    def keys(rows):
        return tuple(torch.randint(-3, 3, (rows, 3), generator=g).to(dtype) for dtype in key_dtypes)

    path = tmp_path / "sorts.onnx"
    legacy_export(
        Sorts(), keys(40), path, opset_version=opset, input_names=names, dynamic_axes={n: {0: "T"} for n in names}
    )
    session = moe_onnx.InferenceSession(str(path))
    for rows in (40, 257):
        inputs = keys(rows)
        got = session.run(None, {name: x.numpy() for name, x in zip(names, inputs)})
        want = Sorts()(*inputs)
        for k, x in enumerate(inputs):
            values, indices, descending, unstable = got[4 * k : 4 * k + 4]
            np.testing.assert_array_equal(values, want[4 * k].numpy())
            np.testing.assert_array_equal(indices, want[4 * k + 1].numpy())
            np.testing.assert_array_equal(descending, want[4 * k + 2].numpy())
            assert sorted(unstable[:, 0]) == list(range(rows))  # a permutation that sorts
            np.testing.assert_array_equal(np.take_along_axis(x.numpy(), unstable, 0), values)


def test_attribute_computed_in_the_trace_is_refused_clearly(tmp_path):
    class Permute(torch.nn.Module):
        def forward(self, tokens, rmap):
            return mt.moe_token_permute_with_routing_map(tokens, rmap, num_out_tokens=tokens.shape[0] * 2)[0]

    with pytest.raises(TypeError, match="num_out_tokens .* is symbolic; ONNX attributes are constants"):
        legacy_export(Permute(), (torch.randn(4, 3), torch.ones(4, 2, dtype=torch.bool)), tmp_path / "p.onnx")


WORLD = 2


def test_collectives_export_on_gloo_ranks_and_run_like_eager_at_another_row_count(tmp_path):
    from tests.torch_legacy_worker import worker

    start_ranks(worker, WORLD, str(tmp_path), directory=str(tmp_path))
    models = [str(tmp_path / f"rank{r}.onnx") for r in range(WORLD)]
    model = onnx.load(models[0])
    ours = [n.op_type for n in model.graph.node if n.domain == moe_onnx.DOMAIN]
    assert ours == ["AllGather", "AllToAll"]
    dims = {o.name: [d.dim_value or d.dim_param for d in o.type.tensor_type.shape.dim] for o in model.graph.output}
    assert dims["gathered"] == [WORLD, WORLD]
    assert isinstance(dims["received"][0], str) and dims["received"][1] == 3  # data-dependent rows: not fixed
    saved = [dict(np.load(tmp_path / f"rank{r}.npz")) for r in range(WORLD)]
    assert saved[0]["other_x"].shape[0] != saved[0]["traced_x"].shape[0]
    for batch in ("traced", "other"):
        feeds = [{"x": s[f"{batch}_x"], "send_counts": s[f"{batch}_send_counts"]} for s in saved]
        for rank, outputs in enumerate(run_threads(models, feeds)):
            for name, got in zip(("received", "recv_counts", "gathered"), outputs):
                assert_same_bits(got, saved[rank][f"{batch}_{name}"], f"rank {rank} {batch} {name}")
