"""Random malformed calls of every op (tests/malformed.py) through the bare kernel and every
executor, in a subprocess: the process exits cleanly, every refusal is a MoeOpError, and
every accepted call gives the bare kernel's bits. Bounded: a fixed number of derandomized
examples per op."""

from __future__ import annotations

import json
import os
import subprocess
import sys

PROGRAM = os.path.join(os.path.dirname(__file__), "malformed.py")


def test_malformed_calls_are_refused_cleanly_or_run_alike():
    result = subprocess.run([sys.executable, PROGRAM, "--examples", "25"], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"the process died ({result.returncode}):\n{result.stderr[-3000:]}"
    lines = result.stdout.splitlines()
    summary = json.loads(next(line for line in lines if line.startswith("SUMMARY "))[len("SUMMARY ") :])
    problems = [line for line in lines if not line.startswith("SUMMARY ")]
    assert summary["problems"] == 0, "\n".join(problems[:20])
    tally = summary["tally"]
    assert tally["ok"] > 40 and tally["refused"] > 40, tally  # both sides of the rules were exercised
