"""make_exports.py remakes the saved corpus (needs torch and fairscale: run with -m peers in their venv)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

EXPORTS = Path(__file__).parent / "data" / "exports"


@pytest.mark.peers
def test_make_exports_remakes_a_saved_export(tmp_path):
    for package in ("torch", "fairscale"):
        try:
            __import__(package)
        except ImportError as err:  # run on purpose with -m peers: missing packages are a failure
            pytest.fail(f"the peers test needs {package} installed (see tests/data/exports/README.md): {err}")
    result = subprocess.run(
        [sys.executable, str(EXPORTS / "make_exports.py"), "--out", str(tmp_path), "--ranks", "2"]
        + ["--layers", "fairscale_top2"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for exporter in ("dynamo", "legacy"):
        name = f"fairscale_top2_{exporter}_n2"
        for r in range(2):
            for batch in ("", "alt_"):
                for kind in ("inputs", "torch_out"):
                    made = np.load(tmp_path / name / f"rank{r}_{batch}{kind}.npz")
                    saved = np.load(EXPORTS / name / f"rank{r}_{batch}{kind}.npz")
                    assert made.files == saved.files
                    for key in made.files:
                        assert np.array_equal(made[key].view(np.uint8), saved[key].view(np.uint8)), (name, r, key)
            made_graph = onnx.load(tmp_path / name / f"rank{r}.onnx").graph
            saved_graph = onnx.load(EXPORTS / name / f"rank{r}.onnx").graph
            assert [n.op_type for n in made_graph.node] == [n.op_type for n in saved_graph.node]
