"""Every served torch_npu / cann_ops_transformer name under hostile arguments (SPEC-layer 1.18
amended, "inputs"): in a subprocess, so an abort fails the test instead of ending the run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_hostile_arguments_are_refused_by_name_never_aborted_or_left_unwritten():
    result = subprocess.run(
        [sys.executable, "-m", "tests.npu_fuzz_worker"], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]  # a crash (abort, segfault) ends here
    report = json.loads(result.stdout.strip().splitlines()[-1])
    counts = report["counts"]
    assert set(counts) <= {"ran", "refused"}, report["examples"]  # no bare error, no unwritten output
    assert counts["refused"] >= 700, counts  # the fuzz reached every name's arguments
    print(counts)
