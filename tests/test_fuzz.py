"""Random malformed calls of every op (tests/malformed.py) through the bare kernel and every
executor, in a subprocess: the process exits cleanly, every refusal is a MoeOpError, and
every accepted call gives the bare kernel's bits (the lowered executor's float sums within
float32 accumulation error). Once with the arrays' shapes in the model, once with symbolic
dims (shape rules checked at run time). Bounded: a fixed number of derandomized examples
per op."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PROGRAM = os.path.join(os.path.dirname(__file__), "malformed.py")


# symbolic: every model dim a symbol, so the shape rules meet the feeds at run time (-m slow)
@pytest.mark.parametrize(
    "dims",
    [["--examples", "20"], pytest.param(["--examples", "15", "--symbolic"], marks=pytest.mark.slow)],
    ids=["static", "symbolic"],
)
def test_malformed_calls_are_refused_cleanly_or_run_alike(dims):
    result = subprocess.run([sys.executable, PROGRAM, *dims], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"the process died ({result.returncode}):\n{result.stderr[-3000:]}"
    lines = result.stdout.splitlines()
    summary = json.loads(next(line for line in lines if line.startswith("SUMMARY "))[len("SUMMARY ") :])
    problems = [line for line in lines if not line.startswith("SUMMARY ")]
    assert summary["problems"] == 0, "\n".join(problems[:20])
    tally = summary["tally"]
    assert tally["ok"] > 30 and tally["refused"] > 30, tally  # both sides of the rules were exercised
