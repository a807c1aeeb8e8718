"""Ctrl-C at random moments of the ``moe-onnx`` commands: every one must end with exit 130
(143 for SIGTERM) and one line on stderr, never an abort; ``bench`` must write the rows it
finished.

    python -m tests.interrupt_trials [--trials 20] [--seed 0] [--signal INT|TERM] [--only NAME ...]

Each trial starts a command in a process group of its own, as a shell does, waits a random
time within the command's own run time (measured first, without a signal) and sends the
signal to the whole group, as a terminal's Ctrl-C does. tests/test_cli_interrupts.py runs a
few of them; this script is the full campaign (its figures are in docs/reliability.md).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import onnx

#: signs that the process died, or printed more than our one line
ABORT_SIGNS = ("terminate called", "Fatal Python error", "Aborted", "core dumped", "Segmentation fault")


def make_models(folder: str) -> dict[str, str]:
    """A 4-rank EP layer exported with a chunk sort (convertible), in ``folder``."""
    from moe_onnx.models.ep_layer import LayerConfig, build_rank_model, make_weights

    config = LayerConfig(ranks=4, hidden=64, ffn=128)
    weights = make_weights(config, seed=0)
    layer = os.path.join(folder, "layer")
    os.makedirs(layer, exist_ok=True)
    for r in range(config.ranks):
        onnx.save(build_rank_model(config, weights, r, "gather_index"), os.path.join(layer, f"rank{r}.onnx"))
    return {"layer": layer}


def commands(folder: str, heavy: bool) -> dict[str, list[str]]:
    """name -> argv after ``moe-onnx``. ``heavy``: bench at a shape whose stock path takes
    seconds (mixtral's rerouting, 2.6 GB peak) instead of the tiny preset."""
    models = make_models(folder)
    shape = ["--shape", "mixtral", "--op", "MoeReRoutingV2", "--repeats", "3"] if heavy else ["--shape", "tiny"]
    out = os.path.join(folder, "out")
    return {
        "bench": ["bench", *shape, "--json", os.path.join(out, "bench.json"), "--markdown", os.path.join(out, "b.md")],
        "bench --no-stock": ["bench", *shape, "--no-stock", "--json", os.path.join(out, "bench.json")],
        # the moment drawn from the end of the first case on: a partial table to write
        "bench mid-run": ["bench", *shape, "--json", os.path.join(out, "bench.json")],
        "run threads": ["run", models["layer"], "--outputs", os.path.join(out, "run")],
        "run mpi": ["run", models["layer"], "--backend", "mpi", "--outputs", os.path.join(out, "run")],
        "convert": ["convert", models["layer"], os.path.join(out, "converted")],
        "lower": ["lower", models["layer"], os.path.join(out, "lowered")],
    }


@dataclass
class Outcome:
    name: str
    delay: float
    code: int
    stderr: str
    rows_done: int  # bench: rows whose progress line was printed
    rows_written: int | None  # bench: rows in --json (None: no file)

    @property
    def aborted(self) -> bool:
        return self.code in (134, -6, -11, 139) or any(sign in self.stderr for sign in ABORT_SIGNS)

    @property
    def lines(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.strip()]

    def problems(self, want: int) -> list[str]:
        found = []
        if self.aborted:
            found.append(f"aborted (exit {self.code})")
        if self.code not in (want, 0):
            found.append(f"exit {self.code}, want {want}: {self.stderr[-300:]!r}")
        if self.code == want and (len(self.lines) != 1 or "interrupted" not in self.lines[0]):
            found.append(f"stderr is not one line: {self.stderr!r}")
        if (
            self.code == want
            and self.name.startswith("bench")
            and self.rows_done
            and self.rows_written != self.rows_done
        ):
            found.append(f"{self.rows_done} row(s) finished, {self.rows_written} written")
        return found


def start(argv: list[str], cwd: str) -> subprocess.Popen:
    """The command in a process group of its own (as a shell's job); stdout piped, stderr to
    a file (``process.stderr_file``), so that stdout can be read line by line, then to the end,
    through one buffer."""
    stderr = tempfile.TemporaryFile("w+")
    process = subprocess.Popen(
        [sys.executable, "-m", "moe_onnx_command", *argv],  # what the moe-onnx script runs
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        start_new_session=True,
    )
    process.stderr_file = stderr  # type: ignore[attr-defined]
    return process


def finish(process: subprocess.Popen, timeout: float = 120) -> tuple[str, str]:
    """(the rest of stdout, all of stderr) once the process has ended."""
    try:
        out = process.stdout.read() if process.stdout else ""
        process.wait(timeout)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    process.stderr_file.seek(0)  # type: ignore[attr-defined]
    return out, process.stderr_file.read()  # type: ignore[attr-defined]


def past_first_row(process: subprocess.Popen) -> list[str]:
    """The bench's stdout lines up to its first finished row."""
    lines = []
    for line in process.stdout or ():
        lines.append(line)
        if " floor |" in line:
            break
    return lines


def duration(name: str, argv: list[str], cwd: str) -> float:
    """Seconds the command runs (for "mid-run": from its first finished row on)."""
    process = start(argv, cwd)
    if "mid-run" in name:
        past_first_row(process)
    began = time.monotonic()
    _, err = finish(process, timeout=600)
    if process.returncode != 0:
        raise RuntimeError(f"moe-onnx {' '.join(argv)} failed without a signal: {err}")
    return time.monotonic() - began


def trial(name: str, argv: list[str], delay: float, signum: int, cwd: str) -> Outcome:
    json_path = argv[argv.index("--json") + 1] if "--json" in argv else None
    if json_path and os.path.exists(json_path):
        os.remove(json_path)
    process = start(argv, cwd)
    before = past_first_row(process) if "mid-run" in name else []
    time.sleep(delay)
    try:
        os.killpg(process.pid, signum)
    except ProcessLookupError:
        pass
    out, err = finish(process)
    out = "".join(before) + out
    rows_done = sum(line.startswith("[") and " floor |" in line for line in out.splitlines())
    rows_written = None
    if json_path and os.path.exists(json_path):
        with open(json_path) as f:
            rows_written = len(json.load(f))
    return Outcome(name, delay, process.returncode, err, rows_done, rows_written)


def campaign(
    trials: int, seed: int, signum: int, only: list[str] | None, heavy: bool, spread: float = 0.6, echo=None
) -> list[Outcome]:
    echo = echo or functools.partial(print, flush=True)
    rng = random.Random(seed)
    want = 128 + signum
    outcomes = []
    with tempfile.TemporaryDirectory() as folder:
        chosen = {n: a for n, a in commands(folder, heavy).items() if not only or n in only}
        lengths = {name: min(duration(name, argv, folder) for _ in range(2)) for name, argv in chosen.items()}
        echo("run time without a signal: " + ", ".join(f"{n} {t:.1f} s" for n, t in lengths.items()))
        for name, argv in chosen.items():
            for _ in range(trials):
                outcome = trial(name, argv, rng.uniform(0.05, spread) * lengths[name], signum, folder)
                outcomes.append(outcome)
                problems = outcome.problems(want)
                echo(
                    f"{name:18} at {outcome.delay:5.2f} s: exit {outcome.code:4}"
                    + (
                        f", {outcome.rows_done} row(s) done, {outcome.rows_written} written"
                        if name.startswith("bench")
                        else ""
                    )
                    + (f"  PROBLEM: {'; '.join(problems)}" if problems else "")
                )
    return outcomes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=20, help="trials per command (default 20)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random moments")
    parser.add_argument("--signal", choices=("INT", "TERM"), default="INT", help="the signal sent (default INT)")
    parser.add_argument("--only", action="append", help="only this command (repeatable): " + "bench, run mpi, ...")
    parser.add_argument("--heavy", action="store_true", help="bench at mixtral's rerouting (2.6 GB), not tiny")
    parser.add_argument(
        "--spread", type=float, default=0.6, help="the moments' range, as a fraction of the run (default 0.6)"
    )
    args = parser.parse_args(argv)
    signum = getattr(signal, f"SIG{args.signal}")
    outcomes = campaign(args.trials, args.seed, signum, args.only, args.heavy, args.spread)
    want = 128 + signum
    for name in dict.fromkeys(o.name for o in outcomes):
        mine = [o for o in outcomes if o.name == name]
        print(
            f"{name}: {len(mine)} trials, {sum(o.aborted for o in mine)} aborts, "
            f"{sum(o.code == want for o in mine)} exit {want}, {sum(o.code == 0 for o in mine)} finished first, "
            f"{sum(bool(o.problems(want)) for o in mine)} with problems"
        )
    return 1 if any(o.problems(want) for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
