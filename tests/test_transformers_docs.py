"""Every block of docs/transformers.md and of the README's "From transformers to cann.moe" runs
as written, in order, in a fresh folder (the bash block with the installed ``moe-onnx``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import onnx

from .test_readme import blocks

ROOT = Path(__file__).parents[1]


def run_blocks(found: list[tuple[str, str]], folder: Path) -> list[str]:
    """Run each (language, code) in ``folder``; the stdout of each."""
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    outputs = []
    for language, code in found:
        command = [sys.executable, "-c", code] if language == "python" else ["bash", "-euo", "pipefail", "-c", code]
        result = subprocess.run(command, cwd=folder, capture_output=True, text=True, timeout=900, env=env)
        assert result.returncode == 0, f"{language} block failed:\n{code}\n{result.stderr[-3000:]}"
        outputs.append(result.stdout)
    return outputs


def test_the_page_runs(tmp_path):
    found = [(language, code) for _, language, code in blocks((ROOT / "docs/transformers.md").read_text())]
    assert [language for language, _ in found] == ["python", "python", "bash", "python", "bash"]
    outputs = run_blocks(found, tmp_path)
    assert "experts -> cann.moe chain; model.layers.0.mlp.gate: MoeGatingTopKSoftmax + renormalisation" in outputs[0]
    assert outputs[2].startswith("fused 2 of 2 MoE block(s)") and "(batched_mm): fused" in outputs[2]
    assert outputs[4].startswith("fused 2 of 2 MoE block(s)") and "(grouped_mm): fused" in outputs[4]
    assert {n.op_type for n in onnx.load(tmp_path / "qwen2_moe_grouped_fused.onnx").graph.node} >= {"GroupedMatmul"}
    assert {n.op_type for n in onnx.load(tmp_path / "qwen2_moe_fused.onnx").graph.node} >= {"SwiGlu", "GroupedMatmul"}
    assert (tmp_path / "fuse.json").exists()


def test_the_readme_section_runs(tmp_path):
    found = [(lang, code) for section, lang, code in blocks((ROOT / "README.md").read_text())
             if section == "From transformers to cann.moe"]  # fmt: skip
    assert [language for language, _ in found] == ["python"]
    (output,) = run_blocks(found, tmp_path)
    assert "experts -> cann.moe chain" in output
    ops = [n.op_type for n in onnx.load(tmp_path / "qwen3_moe.onnx").graph.node if n.domain == "cann.moe"]
    assert ops.count("MoeInitRoutingV3") == 2
