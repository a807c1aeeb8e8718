"""The converter on real exports (tests/data/exports): megatron-core, fairscale and DeepSpeed MoE layers,
exported with torch.onnx.export (dynamo and legacy) per rank for N = 2 and 4.

Only the saved files are used: no torch, no peer package. Each export family is converted and
run once per N (sessions shared by the traced and the alternate batch).
"""

from __future__ import annotations

import functools
import json
import os
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
from moe_onnx.cli import main as cli_main
from moe_onnx.converters import (
    AmbiguousMatch,
    BatchSpecificGraph,
    ConversionError,
    InsertRerouting,
    dropless,
    insert_rerouting,
)
from moe_onnx.launch import mpiexec
from moe_onnx.ranks import RankFailure, ThreadRanks, run_threads
from tests.support import assert_same_bits

EXPORTS = Path(__file__).parent / "data" / "exports"
LAYERS = ("megatron_dropless", "megatron_droppad", "fairscale_top2", "deepspeed_top2")
ALL = [f"{layer}_{exporter}_n{n}" for layer in LAYERS for exporter in ("dynamo", "legacy") for n in (2, 4)]
BATCH_SPECIFIC = [name for name in ALL if name.startswith("megatron_dropless_legacy")]
CONVERTS = [name for name in ALL if name not in BATCH_SPECIFIC]
RULE = {
    "megatron_dropless": "split_concat",
    "megatron_droppad": "drop_pad",
    "fairscale": "gshard",
    "deepspeed": "gshard",
}
BATCHES = ("", "alt_")  # the traced batch and another one


def ranks_of(name: str) -> int:
    return int(name.rsplit("_n", 1)[1])


def rule_of(name: str) -> str:
    return next(rule for prefix, rule in RULE.items() if name.startswith(prefix))


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
    feeds = {b: [dict(np.load(directory / f"rank{r}_{b}inputs.npz")) for r in range(n)] for b in BATCHES}
    torch_out = {b: [np.load(directory / f"rank{r}_{b}torch_out.npz")["output"] for r in range(n)] for b in BATCHES}
    return Export(name, models, [m for m, _ in results], [rep for _, rep in results], feeds, torch_out)


def run_batches(models, feeds_by_batch) -> dict[str, list[np.ndarray]]:
    """Each batch through the same N sessions on thread ranks: ``{batch: [output of rank r]}``."""
    ranks = ThreadRanks(models, timeout=60)
    return {batch: [out for (out,) in ranks.run(feeds)] for batch, feeds in feeds_by_batch.items()}


def count(model: onnx.ModelProto, op_type: str) -> int:
    return sum(1 for n in model.graph.node if n.op_type == op_type)


def test_corpus_is_complete():
    """Every export the tests expect is there, with its inputs and the peer's outputs."""
    dirs = sorted(d.name for d in EXPORTS.iterdir() if d.is_dir())
    assert dirs == sorted(ALL)
    for name in ALL:
        for r in range(ranks_of(name)):
            for suffix in (".onnx", "_inputs.npz", "_torch_out.npz", "_alt_inputs.npz", "_alt_torch_out.npz"):
                assert (EXPORTS / name / f"rank{r}{suffix}").is_file(), (name, r, suffix)


@pytest.mark.parametrize("name", CONVERTS)
def test_export_converts_to_one_rerouting_with_its_restore(name):
    item = export(name)
    for model, converted, report in zip(item.models, item.converted, item.reports):
        (entry,) = [e for e in report.entries if e.status == "converted"]
        assert entry.rule == rule_of(name), str(report)
        assert len(entry.restores) == 1 and "Gather" in entry.restores[0], str(report)
        assert count(converted, "MoeReRoutingV2") == 1
        if name.startswith("megatron"):  # the 1-D probs ride in the same node: one node, not two
            (folded,) = [e for e in report.entries if e.status == "folded"]
            assert entry.folded == [f"AllToAll '{folded.node}' rows ({entry.rule}) as per_token_scales"]
            rerouting = next(n for n in converted.graph.node if n.op_type == "MoeReRoutingV2")
            assert len(rerouting.input) == 3 and rerouting.input[2]
        if entry.rule in ("split_concat", "drop_pad"):  # the chunk sort and its inverse are gone
            assert count(converted, "Transpose") < count(model, "Transpose") or count(converted, "Split") < count(
                model, "Split"
            )
        assert len(converted.graph.node) == report.nodes_after
        onnx.checker.check_model(converted, full_check=True)
        onnx.shape_inference.infer_shapes(converted, strict_mode=True)


@pytest.mark.parametrize("name", CONVERTS)
def test_converted_export_is_bit_identical_and_matches_torch(name):
    item = export(name)
    before = run_batches(item.models, item.feeds)
    after = run_batches(item.converted, item.feeds)
    for batch in BATCHES:
        for rank, (a, b, want) in enumerate(zip(before[batch], after[batch], item.torch_out[batch])):
            assert_same_bits(a, b)
            assert b.shape == want.shape and np.abs(b.astype(np.float64) - want).max() <= 1e-5, (batch, rank)


@pytest.mark.parametrize("name", BATCH_SPECIFIC)
def test_constant_split_export_is_reported_batch_specific(name):
    item = export(name)
    for model, converted, report in zip(item.models, item.converted, item.reports):
        assert converted is model and not report.changed
        flagged = report.batch_specific
        assert [e.node for e in flagged] == ["/layer/AllToAll", "/layer/AllToAll_1"]  # tokens and probs
        for entry, split in zip(flagged, ("/layer/Split'", "/layer/Split_1'")):
            (reason,) = entry.reasons
            assert split in reason and "only holds for that batch" in reason
        assert "batch-specific graph" in str(report)
        with pytest.raises(BatchSpecificGraph, match="/layer/Split"):
            insert_rerouting(model, strict=True)
    # and it is so: the graph refuses another batch (the sizes no longer add up)
    with pytest.raises(RankFailure, match="Split"):
        run_threads(item.models, item.feeds["alt_"], timeout=60)


@pytest.mark.parametrize("name", CONVERTS)
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
    assert rewrite.report.nodes_before == 165 and rewrite.report.nodes_after == 76


def serialized(model: ir.Model) -> bytes:
    return ir.serde.serialize_model(model).SerializeToString()


def test_failure_while_rewriting_leaves_the_model_as_it_was(monkeypatch):
    """A failure half way (the forward rewritten, the restore not) changes nothing."""
    model = ir.serde.deserialize_model(export("megatron_dropless_dynamo_n2").models[0])
    graph, nodes, before = model.graph, list(model.graph), serialized(model)

    def broken(self, restore, index, build):
        build.node("Gather", [restore.inputs[0], index], {"axis": 0}, what="restore")
        raise RuntimeError("injected")

    monkeypatch.setattr(dropless.SplitConcatRestore, "replace", broken)
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
    model = ir.serde.deserialize_model(export("megatron_droppad_dynamo_n2").models[0])
    transpose = next(n for n in model.graph if n.name == "node_transpose_2")
    twin = ir.node("Transpose", [transpose.inputs[0]], {"perm": [1, 0, 2, 3]}, name="twin_transpose")
    shape = ir.val("twin_shape", ir.DataType.INT64, [2], const_value=ir.tensor(np.array([-1, 16], np.int64)))
    model.graph.register_initializer(shape)
    rows = ir.node("Reshape", [twin.outputs[0], shape], name="twin_rows")
    model.graph.extend([twin, rows])
    rows.outputs[0].name = "twin"
    model.graph.outputs.append(rows.outputs[0])
    before = serialized(model)
    with pytest.raises(AmbiguousMatch, match="node_all_to_all__1.*2 restores.*twin_transpose"):
        InsertRerouting()(model)
    assert serialized(model) == before


def test_report_as_json_and_the_cli(tmp_path, capsys):
    source = EXPORTS / "megatron_droppad_legacy_n2" / "rank0.onnx"
    before = source.read_bytes()
    out, report_path = tmp_path / "out.onnx", tmp_path / "report.json"
    assert cli_main(["convert", str(source), str(out), "--json", str(report_path)]) == 0
    assert source.read_bytes() == before
    printed = capsys.readouterr().out
    assert "converted by drop_pad" in printed and "folded" in printed
    data = json.loads(report_path.read_text())
    assert data["changed"] and data["nodes_before"] == 143 and data["nodes_after"] == len(onnx.load(out).graph.node)
    entries = {e["node"]: e for e in data["all_to_all"]}
    tokens, probs, back = entries["/layer/AllToAll"], entries["/layer/AllToAll_1"], entries["/layer/AllToAll_2"]
    assert tokens["status"] == "converted" and tokens["rule"] == "drop_pad"
    assert tokens["counts"] == "constant full([2, 2], 6)" and tokens["restores"] and tokens["removed"]
    assert tokens["added"] == ["/layer/AllToAll/rerouting", "/layer/Flatten_1/restore"]
    assert tokens["folded"] and probs["status"] == "folded" and probs["rerouting"] == "/layer/AllToAll/rerouting"
    assert back["status"] == "skipped" and back["reasons"][0].startswith("the return all-to-all: it sends the rows")


def test_cli_strict_refuses_a_batch_specific_graph(tmp_path, capsys):
    source = EXPORTS / "megatron_dropless_legacy_n2" / "rank0.onnx"
    out = tmp_path / "out.onnx"
    assert cli_main(["convert", str(source), str(out)]) == 0
    assert "only holds for that batch" in capsys.readouterr().out
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
