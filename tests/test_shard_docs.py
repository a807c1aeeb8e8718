"""Every block of docs/expert-parallelism.md runs as written, in order, in a fresh folder
(the README's "Expert parallelism from one model" points there and has no block of its own)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

PAGE = (Path(__file__).parents[1] / "docs" / "expert-parallelism.md").read_text()


def test_every_block_runs(tmp_path, monkeypatch):
    blocks = re.findall(r"(?ms)^```(\w+)\n(.*?)^```", PAGE)
    assert [language for language, _ in blocks] == ["python", "bash", "python"]
    monkeypatch.chdir(tmp_path)
    bin_dir = os.path.dirname(sys.executable)  # the venv's moe-onnx
    env = dict(os.environ, PATH=bin_dir + os.pathsep + os.environ.get("PATH", ""))
    for language, code in blocks:
        if language == "python":
            exec(compile(code, "docs/expert-parallelism.md", "exec"), {})
        else:
            done = subprocess.run(["bash", "-e", "-c", code], capture_output=True, text=True, env=env, timeout=300)
            assert done.returncode == 0, done.stderr
    assert sorted(os.listdir("shards")) == sorted(f"rank{r}.onnx{s}" for r in range(4) for s in ("", ".data"))
    for rank in range(4):
        y = np.load(f"out/rank{rank}.npz")["y"]
        assert y.shape == (np.load(f"rank{rank}.npz")["x"].shape[0], 16)
        lowered = np.load(f"lowered_out/rank{rank}.npz")["y"]
        assert np.abs(lowered - y).max(initial=0) <= 1e-6 * np.abs(y).max(initial=0)
