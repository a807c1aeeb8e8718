"""The benchmark suite runs end to end (tiny preset); it reports, these tests check behaviour."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from moe_onnx.benchmarks.suite import PRESETS, category, moe_cases


def test_bench_command_writes_json_table_and_plot(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "moe_onnx.commands.cli",
            "bench",
            "--shape",
            "tiny",
            "--repeats",
            "1",
            "--json",
            str(tmp_path / "b.json"),
            "--markdown",
            str(tmp_path / "b.md"),
            "--plot",
            str(tmp_path / "b.png"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    rows = json.loads((tmp_path / "b.json").read_text())
    count = len(moe_cases(PRESETS["tiny"]))
    ops = {
        "MoeReRoutingV2",
        "MoeInitRoutingV2Grad",
        "MoeInitRoutingV3",
        "GroupedMatmul",
        "MoeGatingTopK",
        "MoeTokenPermute",
    }
    assert len(rows) == count and {r["op"] for r in rows} >= ops
    for row in rows:
        assert row["floor_s"] > 0 and row["kernel_s"] > 0 and row["session_s"] > 0 and row["pyop_s"] > 0
        assert row["stock_s"] > 0
        assert row["torch_matches"] in (None, True)  # None: no Megatron counterpart for this case
        assert row["lowered_s"] > 0 and row["lowered_matches"] is True
    assert sum(row["torch_matches"] is True for row in rows) >= 11  # torch is a test dependency
    assert (tmp_path / "b.md").read_text().count("\n") == count + 2
    assert (tmp_path / "b.png").read_bytes()[:4] == b"\x89PNG"
    last = moe_cases(PRESETS["tiny"])[-1]
    assert f"[{count}/{count}] {last.op_type} {last.preset}" in result.stdout


def test_categories_follow_the_targets():
    kinds = {(c.op_type, c.preset): category(c) for c in moe_cases(PRESETS["tiny"])}
    assert kinds[("MoeReRoutingV2", "tiny")] == "movement"
    assert kinds[("MoeInitRoutingV2Grad", "tiny dropless")] == "arithmetic"
    assert kinds[("MoeInitRoutingV3", "tiny dropless range 1/8")] == "movement"
    assert kinds[("MoeTokenUnpermuteWithRoutingMapGrad", "tiny plain")] == "movement"
    assert kinds[("MoeTokenUnpermuteWithRoutingMapGrad", "tiny probs")] == "arithmetic"
    assert kinds[("MoeTokenPermute", "tiny")] == kinds[("MoeInitRouting", "tiny")] == "movement"
    assert kinds[("MoeTokenPermuteGrad", "tiny")] == kinds[("MoeTokenUnpermute", "tiny")] == "arithmetic"
    assert kinds[("MoeTokenUnpermuteGrad", "tiny")] == "arithmetic"  # with probs
    assert kinds[("MoeGatingTopK", "tiny")] == kinds[("MoeGatingTopKBackward", "tiny")] == "gating"
    assert kinds[("MoeFinalizeRoutingV2", "tiny")] == kinds[("SwiGlu", "tiny")] == "arithmetic"
    assert kinds[("GroupedMatmul", "tiny bfloat16")] == "matmul"


def test_bench_layer_times_every_path_of_the_tiny_layer(tmp_path):
    """``moe-onnx bench --layer tiny``: a row per batch size with every path, the paths
    computing the same layer (onnxruntime's MoE, the lowered model and torch within float32
    rounding of the session), the table and the plot written."""
    out = tmp_path / "layer"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "moe_onnx.commands.cli",
            "bench",
            "--layer",
            "tiny",
            "--repeats",
            "1",
            "--json",
            str(out / "l.json"),
            "--markdown",
            str(out / "l.md"),
            "--plot",
            str(out / "l.png"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    rows = json.loads((out / "l.json").read_text())
    assert [r["tokens"] for r in rows] == [1, 2, 4, 16, 64, 128, 512, 2048]
    for row in rows:
        paths = ("session", "session bf16", "onnxruntime MoE", "lowered", "lowered, weights fed", "torch eager")
        for path in (*paths, "weights floor"):
            assert row[f"{path} s"] > 0
        assert 1 <= row["hit_experts"] <= 8
        differences = row["max relative difference"]
        assert set(differences) == {"onnxruntime MoE", "lowered", "lowered, weights fed", "torch eager"}
        assert max(differences.values()) < 1e-5, differences
    assert (out / "l.md").read_text().count("| tiny |") == 8
    assert (out / "l.png").stat().st_size > 0


def test_bench_layer_takes_no_op_options(capsys):
    from moe_onnx.commands.cli import main

    code = main(["bench", "--layer", "tiny", "--op", "SwiGlu"])
    assert code == 2
    assert "--layer times the whole layer: it takes no --op, --shape or --no-stock" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_transformers_runs_every_path_on_a_tiny_block():
    """Every path of bench_transformers built, cross-checked (within 1e-5 of the fused block)
    and timed; rows say why a path did not run."""
    from moe_onnx.benchmarks import bench_transformers

    rows = bench_transformers.main(["--shapes", "tiny", "--tokens", "4", "--repeats", "1"])
    (row,) = rows
    assert set(row["to fused"]) == set(bench_transformers.PATHS) and row["skipped"] == {}
    assert max(row["difference"].values()) <= 1e-5
    assert "| tiny | 4 |" in bench_transformers.markdown_table(rows)


def test_bench_chain_times_every_variant_of_the_tiny_layer():
    """bench_chain: a row per batch size with every chain variant timed (their outputs checked
    equal, bit for bit, before timing) and the markdown table."""
    from moe_onnx.benchmarks import bench_chain

    rows = bench_chain.main(["tiny", "--tokens", "1,2", "--repeats", "1"])
    assert [(r["layer"], r["T"], r["caches"]) for r in rows] == [("tiny", 1, "warm"), ("tiny", 2, "warm")]
    for row in rows:
        for path in ("onnxruntime MoE", *bench_chain.VARIANTS):
            assert row[f"{path} ms"] > 0
    assert bench_chain.markdown_table(rows).count("| tiny |") == 2


def test_bench_protocols_times_the_tiny_layer_both_ways():
    """bench_protocols: a row per batch size with both protocols' times and ratios."""
    from moe_onnx.benchmarks import bench_protocols

    rows = bench_protocols.main(["tiny", "--tokens", "1,2", "--repeats", "1"])
    assert [(r["layer"], r["T"]) for r in rows] == [("tiny", 1), ("tiny", 2)]
    for row in rows:
        assert set(row["steady ms"]) == {"session", "MoE quiet", "MoE default"}
        assert all(v > 0 for v in (*row["interleaved ms"].values(), *row["steady ms"].values()))
        assert row["steady MoE default / session"] > 0
    assert bench_protocols.markdown_table(rows).count("| tiny |") == 2
