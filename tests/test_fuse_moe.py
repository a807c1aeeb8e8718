"""moe-onnx fuse / moe_onnx.converters.fuse_moe on transformers-5 exports: the batched_mm form
(torch.onnx.export, dynamo) and the grouped_mm form (transformers' own exporter, which unrolls
grouped_mm per expert).

The reference is the export itself run by stock onnxruntime; the fused model runs in
moe_onnx.InferenceSession and, lowered, in stock onnxruntime again.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch

import moe_onnx
from moe_onnx.converters import fuse_moe

from .transformers_models import VOCAB, tiny_model

LENGTHS = (1, 7, 33)
CHAIN = ("MoeInitRoutingV3", "GroupedMatmul", "MoeFinalizeRoutingV2")


class _Logits(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids, use_cache=False).logits


def _tracing(model, rewrites: bool):
    """``(context, example length)`` of an export: ``export_causal_lm``'s rewrites of the
    family's code (moe_onnx.transformers EXPORT_PATCHES) and its trace length when
    ``rewrites``, else nothing and 7."""
    if not rewrites:
        return contextlib.nullcontext(), 7
    from moe_onnx.transformers.whole import example_length, export_patches

    return export_patches(model), example_length(model)


def export_batched_mm(model_type: str, path, rewrites: bool = False, **config) -> int:
    """transformers' batched_mm experts exported by torch.onnx.export (dynamo), sequence length
    dynamic (under the family's export rewrites when ``rewrites``); the number of MoE layers."""
    model = tiny_model(model_type, **config)
    model.set_experts_implementation("batched_mm")
    context, length = _tracing(model, rewrites)
    ids = torch.randint(3, VOCAB, (1, length))
    dims = {"input_ids": {1: torch.export.Dim("S", min=1, max=1024)}}
    with torch.no_grad(), context:
        program = torch.onnx.export(_Logits(model).eval(), (ids,), dynamo=True, dynamic_shapes=dims, verbose=False)
    program.save(str(path))
    return sum(hasattr(m, "is_transposed") and hasattr(m, "has_gate") for m in model.modules())


def export_grouped_mm(model_type: str, path, rewrites: bool = False) -> int:
    """transformers' default (grouped_mm) experts exported by transformers' own ONNX exporter (the
    only exporter that translates grouped_mm: per expert a Gather of its rows and a MatMul),
    sequence length dynamic (under the family's export rewrites when ``rewrites``); the number
    of MoE layers."""
    from transformers.exporters import OnnxConfig, OnnxExporter

    model = tiny_model(model_type)
    model.set_experts_implementation("grouped_mm")  # the default, said explicitly
    context, length = _tracing(model, rewrites)
    ids = torch.randint(3, VOCAB, (1, length))
    with context:
        exported = OnnxExporter().export(model, {"input_ids": ids}, config=OnnxConfig(dynamic=True))
    ir.save(exported.program, str(path))
    return sum(hasattr(m, "is_transposed") and hasattr(m, "has_gate") for m in model.modules())


def expert_readers(proto: onnx.ModelProto) -> set[tuple[str, str]]:
    """(domain, op) of every node reading a 3-D initializer (the experts' weights)."""
    weights = {i.name for i in proto.graph.initializer if len(i.dims) == 3}
    return {(n.domain, n.op_type) for n in proto.graph.node if weights & set(n.input)}


def ids_of(sequence: int) -> np.ndarray:
    return np.random.default_rng(sequence).integers(3, VOCAB, (1, sequence)).astype(np.int64)


def dispatch_chain_steps(session) -> int:
    """How many of the session's steps run a dispatch and the chain after it as one
    (moe_onnx.runtime.chains): the fused nodes sit back to back, no Cast between them."""
    from moe_onnx.runtime.chains import ExpertChainStep

    steps = session._executor.steps
    return sum(isinstance(step, ExpertChainStep) and step.dispatch is not None for step in steps)


def assert_fused_equals_export(source, fused_path, layers: int) -> None:
    proto = onnx.load(fused_path)
    ops = [(n.domain, n.op_type) for n in proto.graph.node]
    for op in CHAIN:
        assert ops.count(("cann.moe", op)) == layers * (2 if op == "GroupedMatmul" else 1), op
    assert expert_readers(proto) == {("cann.moe", "GroupedMatmul")}
    original = ort.InferenceSession(str(source), providers=["CPUExecutionProvider"])
    fused = moe_onnx.InferenceSession(str(fused_path))
    lowered_proto = moe_onnx.lower(proto, inline=True)
    # each expert's constant weight its own packed Gemm weight: no Loop gathers it per call
    assert "Loop" not in {n.op_type for n in lowered_proto.graph.node}
    assert not [i.name for i in lowered_proto.graph.initializer if len(i.dims) == 3]
    lowered = ort.InferenceSession(lowered_proto.SerializeToString(), providers=["CPUExecutionProvider"])
    for sequence in LENGTHS:
        feeds = {"input_ids": ids_of(sequence)}
        want = original.run(None, feeds)[0]
        for got in (fused.run(None, feeds)[0], lowered.run(None, feeds)[0]):
            assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max(), sequence


@pytest.fixture(scope="module")
def mixtral_export(tmp_path_factory):
    path = tmp_path_factory.mktemp("fuse") / "mixtral_batched_mm.onnx"
    return path, export_batched_mm("mixtral", path)


def fuse_file(source, target):
    model = ir.load(str(source))
    _, report = fuse_moe(model)
    ir.save(model, str(target))
    return report


def test_mixtral_blocks_become_the_chain(mixtral_export, tmp_path):
    source, layers = mixtral_export
    before = expert_readers(onnx.load(source))
    assert before == {("", "GatherND")}  # the batched_mm export copies each row's expert weights
    report = fuse_file(source, tmp_path / "fused.onnx")
    assert [b.status for b in report.blocks] == ["fused"] * layers
    assert {b.gate for b in report.blocks} == {"SwiGlu"}
    assert all("largest relative difference" in b.check for b in report.blocks)
    assert all(b.router.startswith("MoeGatingTopKSoftmax (4 synthetic batches") for b in report.blocks)
    gating = [n for n in onnx.load(tmp_path / "fused.onnx").graph.node if n.op_type == "MoeGatingTopKSoftmax"]
    assert len(gating) == layers and {a.i for n in gating for a in n.attribute} == {2}  # k
    assert_fused_equals_export(source, tmp_path / "fused.onnx", layers)
    assert dispatch_chain_steps(moe_onnx.InferenceSession(str(tmp_path / "fused.onnx"))) == layers


@pytest.mark.parametrize("form", ["batched_mm", "grouped_mm"])
def test_gpt_oss_keeps_its_own_gate_between_the_products(form, tmp_path):
    """Biases (grouped_mm: gathered by the sorted ids, added after each product), [E, K, N]
    weights (stored [E, N, K] by the fuse: transpose_weight 1) and the clamped gate: SwiGlu does
    not compute that gate, so the check rejects it and the graph's own (row-wise) gate nodes
    read the grouped rows."""
    source = tmp_path / "gpt_oss.onnx"
    layers = (export_batched_mm if form == "batched_mm" else export_grouped_mm)("gpt_oss", source)
    report = fuse_file(source, tmp_path / "fused.onnx")
    assert [(b.status, b.gate) for b in report.blocks] == [("fused", "the graph's own gate nodes")] * layers
    # gpt-oss takes the top-k of the logits, then a softmax of those: the renormalised top-k softmax
    assert all(
        b.router.startswith("MoeGatingTopKSoftmax + renormalisation (top-k logits, then softmax) (4 synthetic")
        for b in report.blocks
    ), str(report)
    proto = onnx.load(tmp_path / "fused.onnx")
    assert sum(n.op_type == "MoeGatingTopKSoftmax" for n in proto.graph.node) == layers
    assert not [n for n in proto.graph.node if n.op_type == "TopK"]  # the router's own TopK is gone
    grouped = [n for n in proto.graph.node if n.op_type == "GroupedMatmul"]
    assert all(len(n.input) >= 3 and n.input[2] for n in grouped)  # the biases ride in GroupedMatmul
    assert {a.i for n in grouped for a in n.attribute if a.name == "transpose_weight"} == {1}
    assert sum(len(i.dims) == 3 for i in proto.graph.initializer) == 2 * layers  # in place of the [E, K, N] ones
    assert_fused_equals_export(source, tmp_path / "fused.onnx", layers)


@pytest.mark.slow
@pytest.mark.parametrize("form", ["batched_mm", "grouped_mm"])
@pytest.mark.parametrize("model_type", ["deepseek_v3", "qwen2_moe", "qwen3_moe", "olmoe"])
def test_more_families_fuse(model_type, form, tmp_path):
    """DeepSeek-V3 (shared experts, a dense first layer), Qwen2-MoE (shared expert and its gate)."""
    source = tmp_path / f"{model_type}.onnx"
    layers = (export_batched_mm if form == "batched_mm" else export_grouped_mm)(model_type, source)
    report = fuse_file(source, tmp_path / "fused.onnx")
    assert [(b.form, b.status) for b in report.blocks] == [(form, "fused")] * layers, str(report)
    router = ROUTERS[model_type]
    assert all(b.router.startswith(router) for b in report.blocks), str(report)
    assert_fused_equals_export(source, tmp_path / "fused.onnx", layers)


#: the router each family's blocks get (what the report's router line starts with)
ROUTERS = {
    "deepseek_v3": "MoeGatingTopK (sigmoid, bias, 2 groups keep 1, scale 2.5) (4 synthetic batches",
    "qwen2_moe": "MoeGatingTopKSoftmax (4 synthetic batches",
    "qwen3_moe": "MoeGatingTopKSoftmax (4 synthetic batches",
    "olmoe": "MoeGatingTopKSoftmax (4 synthetic batches",
}


def test_a_block_that_computes_something_else_is_left_as_it_is(mixtral_export, tmp_path):
    """Slots taken column-major (ids transposed before they are flattened): the block is not the
    chain's routing any more; it is reported and stays as it was (gpt-oss's test shows the
    numerical check rejecting a reading: SwiGlu for its clamped gate)."""
    source, layers = mixtral_export
    model = ir.load(str(source))
    weights = {name for name, v in model.graph.initializers.items() if v.shape is not None and len(v.shape) == 3}
    index = next(n for n in model.graph if n.op_type == "GatherND" and n.inputs[0].name in weights).inputs[1]
    reshape = index.producer()
    while reshape.op_type != "Reshape":  # up from the index to where the [T, K] ids are flattened
        reshape = reshape.inputs[0].producer()
    transpose = ir.node("Transpose", [reshape.inputs[0]], {"perm": [1, 0]}, name="column_major")
    model.graph.insert_before(reshape, transpose)
    reshape.replace_input_with(0, transpose.outputs[0])
    ir.save(model, str(tmp_path / "changed.onnx"))
    report = fuse_file(tmp_path / "changed.onnx", tmp_path / "fused.onnx")
    statuses = [b.status for b in report.blocks]
    assert statuses.count("skipped") == 1 and statuses.count("fused") == layers - 1, str(report)
    skipped = next(b for b in report.blocks if b.status == "skipped")
    # the transposed ids read as [T, K] ids too (their shape is inferred); the check rejects every reading
    assert skipped.reasons[0].startswith("no reading of the block computes what it does")
    assert ("", "GatherND") in expert_readers(onnx.load(tmp_path / "fused.onnx"))  # that block's gathers stay
    original = ort.InferenceSession(str(tmp_path / "changed.onnx"), providers=["CPUExecutionProvider"])
    fused = moe_onnx.InferenceSession(str(tmp_path / "fused.onnx"))
    feeds = {"input_ids": ids_of(7)}
    want = original.run(None, feeds)[0]
    assert np.abs(fused.run(None, feeds)[0] - want).max() <= 1e-5 * np.abs(want).max()


def test_a_model_without_moe_is_returned_as_it_was():
    proto = onnx.helper.make_model(
        onnx.helper.make_graph(
            [onnx.helper.make_node("Relu", ["x"], ["y"])],
            "dense",
            [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2])],
            [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2])],
        )
    )
    fused, report = fuse_moe(proto)
    assert fused is proto and not report.changed and report.blocks == []
    assert str(report).startswith("fused 0 of 0 MoE block(s)")


def test_the_command_writes_the_model_and_the_report(mixtral_export, tmp_path):
    source, layers = mixtral_export
    out, report_path = tmp_path / "out.onnx", tmp_path / "report.json"
    result = subprocess.run(
        [sys.executable, "-m", "moe_onnx_command", "fuse", str(source), str(out), "--json", str(report_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith(f"fused {layers} of {layers} MoE block(s)")
    report = json.loads(report_path.read_text())
    assert [b["status"] for b in report["blocks"]] == ["fused"] * layers
    assert_fused_equals_export(source, out, layers)


@pytest.fixture(scope="module")
def mixtral_grouped(tmp_path_factory):
    path = tmp_path_factory.mktemp("fuse") / "mixtral_grouped_mm.onnx"
    return path, export_grouped_mm("mixtral", path)


def test_grouped_mm_blocks_become_the_chain(mixtral_grouped, tmp_path):
    source, layers = mixtral_grouped
    before = onnx.load(source)
    assert expert_readers(before) == {("", "Split")}  # each expert's slice, one MatMul per expert
    assert sum(n.op_type == "MatMul" for n in before.graph.node) >= layers * 2 * 8
    report = fuse_file(source, tmp_path / "fused.onnx")
    assert [(b.form, b.status, b.gate) for b in report.blocks] == [("grouped_mm", "fused", "SwiGlu")] * layers
    assert all(b.router.startswith("MoeGatingTopKSoftmax") for b in report.blocks)
    assert_fused_equals_export(source, tmp_path / "fused.onnx", layers)
    fused = onnx.load(tmp_path / "fused.onnx")
    # the exporter's [E, K, N] weights are stored [E, N, K] again (the decode kernels' layout),
    # in place of the originals, not beside them
    products = [n for n in fused.graph.node if n.op_type == "GroupedMatmul"]
    assert {a.i for n in products for a in n.attribute if a.name == "transpose_weight"} == {1}
    assert sum(len(i.dims) == 3 for i in fused.graph.initializer) == 2 * layers
    assert dispatch_chain_steps(moe_onnx.InferenceSession(str(tmp_path / "fused.onnx"))) == layers


def test_a_grouped_block_with_swapped_expert_rows_is_left_as_it_is(mixtral_grouped, tmp_path):
    """Experts 0 and 1 of one down product multiply each other's rows: every node still reads as
    the grouped_mm form, so only the numerical check can tell; it rejects the block."""
    source, layers = mixtral_grouped
    model = ir.load(str(source))
    products = [
        n
        for n in model.graph
        if n.op_type == "Concat"
        and all(p is not None and p.producer() is not None and p.producer().op_type == "MatMul" for p in n.inputs)
    ]
    concat = products[1]  # the first block's down product
    gathers = [part.producer().inputs[0].producer() for part in concat.inputs[:2]]
    first, second = gathers[0].inputs[1], gathers[1].inputs[1]
    gathers[0].replace_input_with(1, second)
    gathers[1].replace_input_with(1, first)
    ir.save(model, str(tmp_path / "changed.onnx"))
    report = fuse_file(tmp_path / "changed.onnx", tmp_path / "fused.onnx")
    assert [b.status for b in report.blocks] == ["skipped"] + ["fused"] * (layers - 1), str(report)
    assert report.blocks[0].reasons[0].startswith("no reading of the block computes what it does")
    original = ort.InferenceSession(str(tmp_path / "changed.onnx"), providers=["CPUExecutionProvider"])
    fused = moe_onnx.InferenceSession(str(tmp_path / "fused.onnx"))
    feeds = {"input_ids": ids_of(33)}
    want = original.run(None, feeds)[0]
    assert np.abs(fused.run(None, feeds)[0] - want).max() <= 1e-5 * np.abs(want).max()


def test_the_check_gathers_elements_from_more_than_64_columns():
    """The check's evaluation of GatherElements (a DeepSeek router's top-8 of 256 scores):
    onnx.reference's own keeps one index per row past 64 columns; each element is compared
    with a loop here."""
    from moe_onnx.converters.world import World

    rng = np.random.default_rng(0)
    indices = rng.integers(-256, 256, (16, 8)).astype(np.int64)
    short = rng.integers(0, 16, (4, 100)).astype(np.int64)  # fewer columns than data: its first 100
    graph = onnx.helper.make_graph(
        [
            onnx.helper.make_node("GatherElements", ["data", "indices"], ["picked"], axis=1),
            onnx.helper.make_node("GatherElements", ["data", "short"], ["rows"], axis=0),
        ],
        "router",
        [onnx.helper.make_tensor_value_info("data", onnx.TensorProto.FLOAT, [16, 256])],
        [onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None) for n in ("picked", "rows")],
        [onnx.numpy_helper.from_array(indices, "indices"), onnx.numpy_helper.from_array(short, "short")],
    )
    model = ir.serde.deserialize_model(onnx.helper.make_model(graph))
    world = World(model)
    batch = world.batches()[0]
    got = world.evaluate(batch, list(model.graph.outputs), ranks=1)
    x = batch.feeds["data"]
    picked = [[x[i, indices[i, j] % 256] for j in range(8)] for i in range(16)]
    rows = [[x[short[i, j], j] for j in range(100)] for i in range(4)]
    assert np.array_equal(got["picked"], np.array(picked)) and np.array_equal(got["rows"], np.array(rows))


@pytest.mark.slow
def test_deepseek_routing_over_256_experts_fuses(tmp_path):
    """DeepSeek-V3's router at its real expert count (256 experts in 8 groups, top-4 groups,
    top-8): its GatherElements of the chosen scores used to fail the check."""
    source = tmp_path / "deepseek.onnx"
    routing = {"n_routed_experts": 256, "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8}
    layers = export_batched_mm("deepseek_v3", source, **routing)
    report = fuse_file(source, tmp_path / "fused.onnx")
    assert [b.status for b in report.blocks] == ["fused"] * layers, str(report)
    assert all(b.router.startswith("MoeGatingTopK (sigmoid, bias, 8 groups keep 4, scale") for b in report.blocks)
    gating = [n for n in onnx.load(tmp_path / "fused.onnx").graph.node if n.op_type == "MoeGatingTopK"]
    attrs = [{a.name: onnx.helper.get_attribute_value(a) for a in n.attribute} for n in gating]
    assert [(a["k"], a["group_count"], a["k_group"], a["group_select_mode"]) for a in attrs] == [(8, 8, 4, 1)] * layers
    assert_fused_equals_export(source, tmp_path / "fused.onnx", layers)


@pytest.mark.slow
def test_a_sigmoid_router_without_renormalisation_stays(tmp_path):
    """DeepSeek-V3 with ``norm_topk_prob=False``: MoeGatingTopK renormalises sigmoid scores
    always, so the router stays as exported (the block still fuses) and the report says why."""
    source = tmp_path / "deepseek.onnx"
    layers = export_batched_mm("deepseek_v3", source, norm_topk_prob=False)
    report = fuse_file(source, tmp_path / "fused.onnx")
    assert [b.status for b in report.blocks] == ["fused"] * layers, str(report)
    assert {b.router for b in report.blocks} == {
        "left as exported: sigmoid weights not renormalised: MoeGatingTopK renormalises sigmoid scores always"
    }
    assert not [n for n in onnx.load(tmp_path / "fused.onnx").graph.node if n.op_type == "MoeGatingTopK"]
    assert_fused_equals_export(source, tmp_path / "fused.onnx", layers)


def export_legacy_block(implementation: str, path) -> None:
    """Mixtral's MoE block alone by the legacy TorchScript exporter (dynamo=False): the whole
    transformers-5 causal LM does not export with it (aten::diff in the attention-mask code)."""
    model = tiny_model("mixtral")
    model.set_experts_implementation(implementation)
    x = torch.randn(1, 7, model.config.hidden_size)
    with torch.no_grad():
        torch.onnx.export(
            model.model.layers[0].mlp,
            (x,),
            str(path),
            dynamo=False,
            input_names=["hidden_states"],
            dynamic_axes={"hidden_states": {1: "S"}},
            opset_version=18,
        )


def test_the_legacy_exporters_batched_mm_block_fuses(tmp_path):
    """No value shapes in the file (fuse infers them first); x repeated by Tile, not gathered."""
    source = tmp_path / "legacy.onnx"
    export_legacy_block("batched_mm", source)
    assert all(not v.type.tensor_type.shape.dim for v in onnx.load(source).graph.value_info)
    report = fuse_file(source, tmp_path / "fused.onnx")
    assert [(b.form, b.status) for b in report.blocks] == [("batched_mm", "fused")], str(report)
    assert expert_readers(onnx.load(tmp_path / "fused.onnx")) == {("cann.moe", "GroupedMatmul")}
    original = ort.InferenceSession(str(source), providers=["CPUExecutionProvider"])
    fused = moe_onnx.InferenceSession(str(tmp_path / "fused.onnx"))
    for sequence in LENGTHS:
        feeds = {"hidden_states": np.random.default_rng(sequence).standard_normal((1, sequence, 32), np.float32)}
        want = original.run(None, feeds)[0]
        assert np.abs(fused.run(None, feeds)[0] - want).max() <= 1e-5 * np.abs(want).max(), sequence


def test_the_eager_loop_is_named_and_left_as_it_is(tmp_path):
    """transformers' eager experts through the legacy exporter: one expert gathered per index,
    unrolled over the experts the sample hit; each is reported as that, and nothing changes."""
    source = tmp_path / "eager.onnx"
    export_legacy_block("eager", source)
    report = fuse_file(source, tmp_path / "fused.onnx")
    assert report.blocks and {(b.form, b.status) for b in report.blocks} == {("eager", "skipped")}
    assert all("eager experts loop" in b.reasons[0] for b in report.blocks)
    assert not report.changed
