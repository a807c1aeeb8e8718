"""make_exports.py remakes the saved corpus (needs torch and the peer: run with -m peers in their venv)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

EXPORTS = Path(__file__).parent / "data" / "exports"


def remake(tmp_path: Path, packages: tuple[str, ...], arguments: list[str]) -> None:
    """Run make_exports.py with ``arguments`` into ``tmp_path``; missing ``packages`` fail the test."""
    for package in packages:
        try:
            __import__(package)
        except ImportError as err:  # run on purpose with -m peers: missing packages are a failure
            pytest.fail(f"the peers test needs {package} installed (see tests/data/exports/README.md): {err}")
    result = subprocess.run(
        [sys.executable, str(EXPORTS / "make_exports.py"), "--out", str(tmp_path), *arguments],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]


def assert_same_as_saved(tmp_path: Path, name: str, ranks: int, batches: tuple[str, ...]) -> None:
    """Every npz bit for bit as saved; each graph with the saved graph's nodes (op types, in order)."""
    for r in range(ranks):
        for batch in batches:
            for kind in ("inputs", "torch_out"):
                made = np.load(tmp_path / name / f"rank{r}_{batch}{kind}.npz")
                saved = np.load(EXPORTS / name / f"rank{r}_{batch}{kind}.npz")
                assert made.files == saved.files
                for key in made.files:
                    assert np.array_equal(made[key].view(np.uint8), saved[key].view(np.uint8)), (name, r, key)
        made_graph = onnx.load(tmp_path / name / f"rank{r}.onnx").graph
        saved_graph = onnx.load(EXPORTS / name / f"rank{r}.onnx").graph
        assert [n.op_type for n in made_graph.node] == [n.op_type for n in saved_graph.node]


@pytest.mark.peers
def test_make_exports_remakes_a_saved_export(tmp_path):
    remake(tmp_path, ("torch", "fairscale"), ["--ranks", "2", "--layers", "fairscale_top2"])
    for exporter in ("dynamo", "legacy"):
        assert_same_as_saved(tmp_path, f"fairscale_top2_{exporter}_n2", 2, ("", "alt_"))


@pytest.mark.peers
def test_make_exports_remakes_a_saved_torchtitan_export(tmp_path):
    name = "torchtitan_dynamo_n2_l2_k2"
    remake(tmp_path, ("torch", "torchtitan"), ["--variants", name])
    assert_same_as_saved(tmp_path, name, 2, ("", "alt_", "skew_"))
