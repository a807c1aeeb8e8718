"""The converter on real exports (tests/data/exports): megatron-core, fairscale, DeepSpeed and torchtitan MoE layers,
exported with torch.onnx.export (dynamo and legacy) per rank.

The first corpus (N = 2 and 4, L = 2, top-2, static token counts) and the later exports of
make_exports.VARIANTS (N = 2-4, L = 3, K = 1-3, uneven tokens per rank, symbolic token counts,
DeepSpeed without dropped tokens, Megatron's split sizes copied to the host). Only the saved files
are used: no torch, no peer package. Each export is converted and run once (sessions shared by
its batches).
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest

import moe_onnx
from moe_onnx.commands.cli import main as cli_main
from moe_onnx.commands.launch import mpiexec
from moe_onnx.converters import (
    BatchSpecificGraph,
    ConversionError,
    InsertRerouting,
    insert_rerouting,
    movement_map,
)
from moe_onnx.ranks import RankFailure, ThreadRanks
from tests.support import assert_same_bits

EXPORTS = Path(__file__).parent / "data" / "exports"
LAYERS = ("megatron_dropless", "megatron_droppad", "fairscale_top2", "deepspeed_top2")
FIRST = [f"{layer}_{exporter}_n{n}" for layer in LAYERS for exporter in ("dynamo", "legacy") for n in (2, 4)]
#: torchtitan 0.3.0's MoE + AllToAllTokenDispatcher (issue 29): its chunk sort a GatherND of the
#: received rows by a repeat_interleave index, its restore a ScatterND; its counts exchanged by an
#: AllToAll of their own
TORCHTITAN = [
    "torchtitan_dynamo_n2_l2_k2",  # softmax top-2, static T (the counts computed all the same)
    "torchtitan_dynamo_n2_l2_k2_dyn",
    "torchtitan_dynamo_n4_l2_k2_dyn",
    "torchtitan_dynamo_n2_l4_k8_sigmoid",  # top-8 of E = 8, sigmoid scores with route_norm
    "torchtitan_dynamo_n2_l2_k1_dyn",
]
#: torchtitan's TorchAOTokenDispatcher (rows per expert padded to a multiple of 8, the padding a
#: zero row appended to the received rows): not a pure chunk sort, every all-to-all skipped
PADDED = "torchtitan_dynamo_n2_l2_k2_dyn_padded"
LATER = [
    "megatron_dropless_dynamo_n3_l3_k3",
    "megatron_dropless_legacy_n3_l3_k3",
    "megatron_dropless_dynamo_n4_l3_k1_dyn",
    "megatron_droppad_dynamo_n4_l3_k1_dyn",
    "megatron_droppad_legacy_n3_l3_k3",
    "fairscale_top2_dynamo_n3_l3_k2_dyn",
    "fairscale_top2_legacy_n3_l3_k2_dyn",
    "fairscale_top2_legacy_n3_l3_k2",
    "deepspeed_drop_dynamo_n4_l3_k2_dyn",
    "deepspeed_drop_legacy_n3_l3_k2",
    "deepspeed_drop_dynamo_n3_l3_k3",
    "deepspeed_nodrop_dynamo_n3_l3_k2_dyn",
    "deepspeed_nodrop_legacy_n3_l3_k2",
    "megatron_dropless_legacy_n2_l2_k2_host",
    "deepspeed_residual_dynamo_n2_l2_k2",  # the public deepspeed.moe.layer.MoE, residual MLP
    "deepspeed_fp16_dynamo_n2_l2_k2",  # the same MoE in float16 (its gate float32)
    "megatron_dropless_dynamo_n2_l4_k8_shared",  # top-8 of E = 8, with a shared expert
    "megatron_dropless_dynamo_n2_l2_k2_groups",  # group-limited routing (a group per rank, top-1 group)
    "megatron_droppad_dynamo_n2_l2_k2_position",  # drop-and-pad, moe_token_drop_policy="position"
    "megatron_dropless_dynamo_n2_l2_k2_two_layers",  # two MoE layers in one graph
    *TORCHTITAN,
]
#: MoE layers per graph (1 where not listed)
MOE_LAYERS = {"megatron_dropless_dynamo_n2_l2_k2_two_layers": 2}
#: exports whose own graph computes other values than the peer's torch on the traced batch
#: already (so the converted one, bit-identical to it, too): the "position" drop policy keeps
#: each expert's slots by torch.topk over a 0/1 routing map, whose ties torch (sorted=False) and
#: onnxruntime's TopK break differently
TORCH_DIFFERS = {"megatron_droppad_dynamo_n2_l2_k2_position"}
ALL = FIRST + LATER
#: how far from the peer's torch output a converted export may be where its graph holds: float32
#: exports 1e-5; float16 one unit in the last place of outputs up to 8 (torch and onnxruntime
#: round float16 products and sums differently)
TOLERANCE = {"deepspeed_fp16_dynamo_n2_l2_k2": 2**-7}
#: the exports whose graph holds only for the batch it was traced with, and a batch on which the
#: original graph (so the converted one too) fails or computes other values than the peer's torch
BATCH_SPECIFIC = {
    "megatron_dropless_legacy_n2": "alt_",  # split sizes traced as constants: the Split refuses
    "megatron_dropless_legacy_n4": "alt_",
    "megatron_dropless_legacy_n3_l3_k3": "alt_",
    "megatron_dropless_legacy_n2_l2_k2_host": "alt_",  # send counts constant too: silently wrong
    "deepspeed_drop_dynamo_n4_l3_k2_dyn": "long_",  # capacity frozen at min_capacity = 4
    "deepspeed_nodrop_legacy_n3_l3_k2": "skew_",  # capacity = the traced batch's largest expert count
}
#: how the counts of the converted chunk sort are obtained, by export name prefix
COUNTS = {
    "megatron_dropless_dynamo": "computed: Reshape('slice_",  # from the AllGather of the counts
    "megatron_dropless_legacy": "constant [[",  # traced split sizes
    "megatron_droppad_dynamo_n4_l3_k1_dyn": "computed: full([4, 3], rows / 12)",  # C symbolic
    "megatron_droppad": "constant full(",
    "fairscale": "computed: full(",  # the AllToAll's received blocks: no static count
    "deepspeed": "computed: full(",
    "torchtitan": "computed: 'all_to_all_single' [",  # the received counts of its counts AllToAll
}


def ranks_of(name: str) -> int:
    return int(re.search(r"_n(\d+)", name).group(1))  # type: ignore[union-attr]


def batches_of(name: str) -> list[str]:
    """The batch prefixes: "" (traced), "alt_", and for the later exports "skew_" (+ "long_", "short_")."""
    found = sorted(p.name[len("rank0_") : -len("inputs.npz")] for p in (EXPORTS / name).glob("rank0_*_inputs.npz"))
    return ["", *found]


def counts_of(name: str) -> str:
    return next(text for prefix, text in COUNTS.items() if name.startswith(prefix))


@dataclass
class Export:
    name: str
    models: list[onnx.ModelProto]
    converted: list[onnx.ModelProto]
    reports: list
    feeds: dict[str, list[dict[str, np.ndarray]]]  # batch prefix -> per rank
    torch_out: dict[str, list[np.ndarray]]


@functools.cache
def export(name: str) -> Export:
    directory = EXPORTS / name
    n = ranks_of(name)
    models = [onnx.load(directory / f"rank{r}.onnx") for r in range(n)]
    results = [insert_rerouting(m) for m in models]
    batches = batches_of(name)
    feeds = {b: [dict(np.load(directory / f"rank{r}_{b}inputs.npz")) for r in range(n)] for b in batches}
    torch_out = {b: [np.load(directory / f"rank{r}_{b}torch_out.npz")["output"] for r in range(n)] for b in batches}
    return Export(name, models, [m for m, _ in results], [rep for _, rep in results], feeds, torch_out)


def run_batches(models, feeds_by_batch) -> dict[str, list[np.ndarray] | RankFailure]:
    """Each batch through the same N sessions on thread ranks: ``{batch: [output of rank r]}``,
    or the failure."""
    ranks = ThreadRanks(models, timeout=60)
    found: dict[str, list[np.ndarray] | RankFailure] = {}
    for batch, feeds in feeds_by_batch.items():
        try:
            found[batch] = [out for (out,) in ranks.run(feeds)]
        except RankFailure as failure:
            found[batch] = failure
    return found


def count(model: onnx.ModelProto, op_type: str) -> int:
    return sum(1 for n in model.graph.node if n.op_type == op_type)


def test_corpus_is_complete():
    """Every export the tests expect is there, with its inputs and the peer's outputs."""
    dirs = sorted(d.name for d in EXPORTS.iterdir() if d.is_dir())
    assert dirs == sorted([*ALL, PADDED])
    for name in [*ALL, PADDED]:
        batches = batches_of(name)
        assert batches[:2] == ["", "alt_"] and (name in FIRST or "skew_" in batches), batches
        assert ("long_" in batches) == bool(re.search(r"_dyn(_|$)", name))
        for r in range(ranks_of(name)):
            assert (EXPORTS / name / f"rank{r}.onnx").is_file(), (name, r)
            for batch in batches:
                for kind in ("inputs", "torch_out"):
                    assert (EXPORTS / name / f"rank{r}_{batch}{kind}.npz").is_file(), (name, r, batch)
        if name in LATER or name == PADDED:
            record = json.loads((EXPORTS / name / "export.json").read_text())
            assert record["ranks"] == ranks_of(name) and len(record["tokens"]) == ranks_of(name)


@pytest.mark.parametrize("name", ALL)
def test_export_converts_to_one_rerouting_with_its_restore(name):
    item = export(name)
    layers = MOE_LAYERS.get(name, 1)
    for converted, report in zip(item.converted, item.reports):
        entries = [e for e in report.entries if e.status == "converted"]
        assert len(entries) == layers and count(converted, "MoeReRoutingV2") == layers, str(report)
        folded = [e for e in report.entries if e.status == "folded"]
        for layer, entry in enumerate(entries):
            assert entry.rule == "movement_map" and entry.counts.startswith(counts_of(name)), str(report)
            assert entry.movement and re.search(r"<- experts? 0\b", entry.movement), str(report)
            assert len(entry.restores) == 1 and "Gather" in entry.restores[0], str(report)
            if name.startswith("megatron"):  # the 1-D probs ride in the same node: one node, not two
                assert entry.folded == [f"AllToAll '{folded[layer].node}' rows (movement_map) as per_token_scales"]
                rerouting = next(n for n in converted.graph.node if n.name == entry.rerouting)
                assert len(rerouting.input) == 3 and rerouting.input[2]
            # the chunk sort is gone: the received rows are read by the MoeReRoutingV2 only (through a
            # Reshape to rows where the AllToAll moved [E, C, M] blocks; Shape: C computed from them)
            received = next(n for n in converted.graph.node if n.name == entry.node).output[0]
            readers = {n.op_type for n in converted.graph.node if received in n.input}
            assert readers <= {"MoeReRoutingV2", "Reshape", "Shape"} and readers, readers
        assert bool(report.batch_specific) == (name in BATCH_SPECIFIC), str(report)
        assert len(converted.graph.node) == report.nodes_after
        onnx.checker.check_model(converted, full_check=True)
        onnx.shape_inference.infer_shapes(converted, strict_mode=True)


@pytest.mark.parametrize("name", ALL)
def test_converted_export_is_bit_identical_on_every_batch(name):
    """Bit for bit the original's outputs on every saved batch (both fail where the original
    fails); and the peer's torch outputs within 1e-5 wherever the graph holds."""
    item = export(name)
    before = run_batches(item.models, item.feeds)
    after = run_batches(item.converted, item.feeds)
    for batch in batches_of(name):
        if isinstance(before[batch], RankFailure):
            assert isinstance(after[batch], RankFailure), (name, batch)
            assert name in BATCH_SPECIFIC, (name, batch, before[batch])
            continue
        for rank, (a, b, want) in enumerate(zip(before[batch], after[batch], item.torch_out[batch])):
            assert_same_bits(a, b)
            assert b.shape == want.shape
            error = np.abs(b.astype(np.float64) - want).max()
            if name in TORCH_DIFFERS:
                assert batch != "" or error > 1e-2, (batch, rank, error)  # as the note says
            elif name not in BATCH_SPECIFIC or batch == "":
                assert error <= TOLERANCE.get(name, 1e-5), (batch, rank, error)


@pytest.mark.parametrize("name", sorted(BATCH_SPECIFIC))
def test_batch_specific_export_is_warned_and_fails_on_another_batch(name):
    item = export(name)
    for model, report in zip(item.models, item.reports):
        assert report.changed  # converted all the same: bit for bit what the original does
        assert all(w.startswith("batch-specific: ") for e in report.batch_specific for w in e.warnings)
        assert "WARNING: batch-specific graph" in str(report)
        assert report.to_dict()["batch_specific"] == [e.node for e in report.batch_specific]
        with pytest.raises(BatchSpecificGraph, match="only holds for the batch it was traced with"):
            insert_rerouting(model, strict=True)
    # and it is so: on this batch the original graph fails, or computes other values than torch
    batch = BATCH_SPECIFIC[name]
    outputs = run_batches(item.models, {batch: item.feeds[batch]})[batch]
    if not isinstance(outputs, RankFailure):
        worst = max(float(np.abs(o.astype(np.float64) - w).max()) for o, w in zip(outputs, item.torch_out[batch]))
        assert worst > 1e-2, worst


def test_batch_specific_warnings_say_what_the_graph_computes():
    """The warning of each kind names its evidence."""
    texts = {name: " ".join(w for e in export(name).reports[0].entries for w in e.warnings) for name in BATCH_SPECIFIC}
    assert "every rank sends this rank" in texts["megatron_dropless_legacy_n2_l2_k2_host"]
    assert "but the counts constant [[" in texts["megatron_dropless_legacy_n3_l3_k3"]
    assert "the capacity is the constant 4 rows per expert" in texts["deepspeed_drop_dynamo_n4_l3_k2_dyn"]
    assert "'tokens'" in texts["deepspeed_drop_dynamo_n4_l3_k2_dyn"]
    assert "the original graph fails on the skewed batch" in texts["deepspeed_nodrop_legacy_n3_l3_k2"]
    assert "ScatterElements" in texts["deepspeed_nodrop_legacy_n3_l3_k2"]


@pytest.mark.parametrize("name", ALL)
def test_conversion_is_idempotent(name):
    converted = export(name).converted[0]
    again, report = insert_rerouting(converted)
    assert again is converted and not report.changed
    assert any(e.status == "already converted" for e in report.entries)


def test_ir_model_converts_in_one_pass_like_a_proto():
    """Tokens and probs sorted by the same counts and sharing one restore: one pass, one node."""
    item = export("megatron_dropless_dynamo_n4")
    model = ir.serde.deserialize_model(item.models[1])
    rewrite = InsertRerouting()
    rewrite(model)
    converted = ir.serde.serialize_model(model)
    assert count(converted, "MoeReRoutingV2") == 1 and len(converted.graph.node) == len(item.converted[1].graph.node)
    assert rewrite.report.nodes_before == 165 and rewrite.report.nodes_after == 66


def serialized(model: ir.Model) -> bytes:
    return ir.serde.serialize_model(model).SerializeToString()


def test_failure_while_rewriting_leaves_the_model_as_it_was(monkeypatch):
    """A failure half way (the forward rewritten, the restore not) changes nothing."""
    model = ir.serde.deserialize_model(export("megatron_dropless_dynamo_n2").models[0])
    graph, nodes, before = model.graph, list(model.graph), serialized(model)

    def broken(self, restore, index, build):
        build.node("Gather", [restore.inputs[0], index], {"axis": 0}, what="restore")
        raise RuntimeError("injected")

    monkeypatch.setattr(movement_map.MovementRestore, "replace", broken)
    with pytest.raises(ConversionError, match=r"node_all_to_all__1.*node_Split_\d+.*node_cat_3.*injected"):
        InsertRerouting()(model)
    assert model.graph is graph and list(model.graph) == nodes and serialized(model) == before


def test_failure_while_matching_leaves_the_model_as_it_was(monkeypatch):
    model = ir.serde.deserialize_model(export("fairscale_top2_dynamo_n2").models[0])
    before = serialized(model)

    def broken(*args, **kwargs):
        raise KeyError("injected")

    monkeypatch.setattr(InsertRerouting, "_find_restores", staticmethod(broken))
    with pytest.raises(ConversionError):
        InsertRerouting()(model)
    assert serialized(model) == before


def test_two_restores_are_ambiguous_and_nothing_changes():
    """A second inverse of the chunk sort sent by a second all-to-all: two restores; the tokens'
    and the folded probs' all-to-alls are skipped with that reason."""
    model = ir.serde.deserialize_model(export("megatron_droppad_dynamo_n2").models[0])
    transpose = next(n for n in model.graph if n.name == "node_transpose_2")
    back = next(n for n in model.graph if n.name == "node_all_to_all_2__1")
    twin = ir.node("Transpose", [transpose.inputs[0]], {"perm": [1, 0, 2, 3]}, name="twin_transpose")
    shape = ir.val("twin_shape", ir.DataType.INT64, [2], const_value=ir.tensor(np.array([-1, 16], np.int64)))
    model.graph.register_initializer(shape)
    rows = ir.node("Reshape", [twin.outputs[0], shape], name="twin_rows")
    send = ir.node("AllToAll", [rows.outputs[0], back.inputs[1]], domain=moe_onnx.DOMAIN, num_outputs=2, name="twin")
    model.graph.extend([twin, rows, send])
    send.outputs[0].name = "twin"
    model.graph.outputs.append(send.outputs[0])
    before = serialized(model)
    rewrite = InsertRerouting()
    rewrite(model)
    assert not rewrite.report.changed and serialized(model) == before
    by_node = {e.node: e for e in rewrite.report.entries}
    for node in ("node_all_to_all__1", "node_all_to_all_1__1"):  # the tokens and the probs
        reasons = " ".join(by_node[node].reasons)
        assert by_node[node].status == "skipped", rewrite.report
        assert re.search(r"ambiguous: AllToAll 'node_all_to_all__1'.*: 2 restores.*twin_transpose", reasons), reasons


def test_report_as_json_and_the_cli(tmp_path, capsys):
    source = EXPORTS / "megatron_droppad_legacy_n2" / "rank0.onnx"
    before = source.read_bytes()
    out, report_path = tmp_path / "out.onnx", tmp_path / "report.json"
    assert cli_main(["convert", str(source), str(out), "--json", str(report_path)]) == 0
    assert source.read_bytes() == before
    printed = capsys.readouterr().out
    assert "converted by movement_map" in printed and "folded" in printed
    data = json.loads(report_path.read_text())
    assert data["changed"] and data["nodes_before"] == 143 and data["nodes_after"] == len(onnx.load(out).graph.node)
    entries = {e["node"]: e for e in data["all_to_all"]}
    tokens, probs, back = entries["/layer/AllToAll"], entries["/layer/AllToAll_1"], entries["/layer/AllToAll_2"]
    assert tokens["status"] == "converted" and tokens["rule"] == "movement_map"
    assert tokens["movement"].startswith("probed on shapes: ") and tokens["warnings"] == []
    assert tokens["counts"] == "constant full([2, 2], 6)" and tokens["restores"] and tokens["removed"]
    # the rerouting; the experts' split of its rows, tokens and probs (and the probs unsqueezed as
    # the experts read them); the restore: their outputs stacked, gathered by the scatter index
    assert tokens["added"] == [
        "/layer/AllToAll/rerouting",
        "/layer/AllToAll/experts",
        "/layer/AllToAll/experts_2",
        "/layer/AllToAll/expert_input",
        "/layer/AllToAll/expert_input_1",
        "/layer/Flatten_1/expert_major",
        "/layer/Flatten_1/restore",
    ]
    assert tokens["folded"] and probs["status"] == "folded" and probs["rerouting"] == "/layer/AllToAll/rerouting"
    assert back["status"] == "skipped" and back["reasons"][0].startswith("the return all-to-all: it sends the rows")


def test_cli_strict_refuses_a_batch_specific_graph(tmp_path, capsys):
    source = EXPORTS / "megatron_dropless_legacy_n2" / "rank0.onnx"
    out = tmp_path / "out.onnx"
    assert cli_main(["convert", str(source), str(out)]) == 0
    assert "only holds for the batch it was traced with" in capsys.readouterr().out
    os.remove(out)
    try:
        code = cli_main(["convert", str(source), str(out), "--strict"])
        message = capsys.readouterr().err
    except BatchSpecificGraph as refused:  # the command may also print it and return a code
        code, message = 1, str(refused)
    assert code != 0 and "/layer/Split" in message and not out.exists()


#: one export per peer, all N = 4, in one MPI job
MPI_CASES = ["megatron_dropless_dynamo_n4", "fairscale_top2_legacy_n4", "deepspeed_top2_dynamo_n4"]


@pytest.mark.mpi
def test_converted_exports_on_mpi(tmp_path):
    """One export per peer on 4 MPI processes: the same bits as the unconverted model on threads."""
    for name in MPI_CASES:
        (tmp_path / name).mkdir()
        for r, model in enumerate(export(name).converted):
            onnx.save(model, tmp_path / name / f"rank{r}.onnx")
            shutil.copy(EXPORTS / name / f"rank{r}_inputs.npz", tmp_path / name)
    env = dict(os.environ)
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    job = Path(__file__).parent / "mpi_corpus_job.py"
    command = [mpiexec(), "--oversubscribe", "-n", "4", sys.executable, str(job), str(tmp_path / "out")]
    result = subprocess.run(
        command + [str(tmp_path / name) for name in MPI_CASES], capture_output=True, text=True, timeout=300, env=env
    )
    assert result.returncode == 0, result.stdout + result.stderr
    for name in MPI_CASES:
        item = export(name)
        before = run_batches(item.models, {"": item.feeds[""]})[""]
        for r in range(4):
            got = np.load(tmp_path / "out" / name / f"rank{r}.npz")["output"]
            assert_same_bits(before[r], got)
            assert np.abs(got.astype(np.float64) - item.torch_out[""][r]).max() <= 1e-5


def test_megatron_exports_need_the_all_gather_op():
    """The dropless Megatron graphs exchange counts with cann.moe::AllGather (run above, unchanged)."""
    ops = {(n.domain, n.op_type) for n in export("megatron_dropless_dynamo_n2").models[0].graph.node}
    assert (moe_onnx.DOMAIN, "AllGather") in ops and (moe_onnx.DOMAIN, "AllToAll") in ops


#: dynamo exports whose received rows are [E, C, M] blocks, C symbolic (or frozen: then, E
#: declared, the rows are static and so are the counts), and their counts once E is declared
BLOCK_EXPORTS = {
    "fairscale_top2_dynamo_n3_l3_k2_dyn": "computed: full([3, 3], rows / 9)",
    "deepspeed_nodrop_dynamo_n3_l3_k2_dyn": "computed: full([3, 3], rows / 9)",
    "deepspeed_drop_dynamo_n4_l3_k2_dyn": "constant full([4, 3], 4)",
}


def declared_blocks(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with each AllToAll's received dim 0 declared as its sent dim 0 (E), as exports
    from other exporter versions declare it: ``[E, C, M]`` with only C symbolic."""
    ir_model = ir.serde.deserialize_model(model)
    for node in ir_model.graph:
        if node.op_type == "AllToAll" and node.inputs[0].shape is not None and node.outputs[0].shape is not None:
            sent, received = node.inputs[0].shape, node.outputs[0].shape
            node.outputs[0].shape = ir.Shape([sent[0], *list(received)[1:]])
    return ir.serde.serialize_model(ir_model)


@pytest.mark.parametrize("name", sorted(BLOCK_EXPORTS))
def test_blocks_with_a_declared_block_count_pass_the_long_probe(name):
    """The long probe stretches the dim that is unknown: C of ``[E, C, M]`` when E is declared (it
    used to stretch dim 0 only, leaving C = 1, and refused these layers: "holds ... for C = [1, 2,
    3, 5] rows per block but not for a long probe of C = 4096 (rows [9, 1, 16])")."""
    item = export(name)
    models = [declared_blocks(m) for m in item.models]
    converted = []
    for model, before in zip(models, item.reports):
        new, report = insert_rerouting(model)
        (entry,) = [e for e in report.entries if e.status == "converted"]
        assert entry.counts.startswith(BLOCK_EXPORTS[name]) and len(entry.restores) == 1, str(report)
        assert bool(report.batch_specific) == bool(before.batch_specific), str(report)
        converted.append(new)
    before = run_batches(models, item.feeds)
    after = run_batches(converted, item.feeds)
    for batch in batches_of(name):
        if isinstance(before[batch], RankFailure):
            assert isinstance(after[batch], RankFailure) and name in BATCH_SPECIFIC
            continue
        for a, b in zip(before[batch], after[batch]):
            assert_same_bits(a, b)


@pytest.mark.parametrize("name", TORCHTITAN)
def test_torchtitan_gather_nd_sort_and_scatter_nd_restore_are_replaced(name):
    """torchtitan's ``_permute`` (``x[idx]``: GatherND with an index ``[R, 1]``) and ``_unpermute``
    (``out[idx] = y``: ScatterND) are the chunk sort and its restore: both gone, the rows read by
    the MoeReRoutingV2 alone; its other two all-to-alls are skipped, each saying what it is."""
    item = export(name)
    for model, converted, report in zip(item.models, item.converted, item.reports):
        assert count(model, "ScatterND") == 1 and count(converted, "ScatterND") == 0
        assert count(model, "GatherND") > count(converted, "GatherND")
        (entry,) = [e for e in report.entries if e.status == "converted"]
        assert "ScatterND" in entry.restores[0] and any(n.startswith("node_GatherND") for n in entry.removed)
        skipped = {e.reasons[0].split(":")[0] for e in report.entries if e.status == "skipped"}
        assert skipped == {"the counts all-to-all", "the return all-to-all"}, str(report)
        counts_entry = next(e for e in report.entries if e.reasons and e.reasons[0].startswith("the counts"))
        assert counts_entry.reasons[0].endswith(f"of AllToAll '{entry.node}'")


def test_torchtitan_padded_permutation_is_skipped_with_its_reason():
    """torchtitan's padded permutation (``TorchAOTokenDispatcher``, ``pad_multiple`` 8) appends a zero
    row to the received rows and picks it for each expert's padding rows: not MoeReRoutingV2's
    order, so nothing is converted, the token all-to-all saying why; the graph itself is torch's."""
    item = export(PADDED)
    for model, converted, report in zip(item.models, item.converted, item.reports):
        assert not report.changed and converted is model and not report.batch_specific, str(report)
        assert [e.status for e in report.entries] == ["skipped"] * 3
        reasons = " ".join(r for e in report.entries for r in e.reasons)
        assert "joined with other rows by SequenceConstruct" in reasons and "not a pure chunk sort" in reasons
    outputs = run_batches(item.models, item.feeds)
    for batch in batches_of(PADDED):
        for got, want in zip(outputs[batch], item.torch_out[batch]):  # type: ignore[arg-type]
            assert np.abs(got.astype(np.float64) - want).max() <= 1e-5, batch
