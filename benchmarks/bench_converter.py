"""Original vs converted MoE layers on 4 in-process ranks: node counts and time per forward.

usage: python -m moe_onnx.benchmarks.bench_converter [--only corpus|ep-layer] [--corpus DIR] [--repeats R]

* ``corpus``: the real exports of ``tests/data/exports`` (megatron-core, fairscale, DeepSpeed, torchtitan;
  dynamo and legacy): the first corpus' N = 4 exports and every later one (``export.json``:
  N = 2-4, L = 3, K = 1-3, symbolic token counts), each at its own N on its traced batch, as
  saved (tiny layers: the time is mostly per-node overhead);
* ``ep-layer``: the synthetic EP layer of ``models/ep_layer.py`` at a realistic size.

Both model sets run on the split executor, one session per rank made once; forwards of the
original and the converted layer alternate, round after round, so a noisy spell slows both
alike; each ratio is the median of the per-round ratios.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import onnx

from moe_onnx.converters import insert_rerouting
from moe_onnx.models.ep_layer import PATTERNS, LayerConfig, build_rank_model, example_inputs, make_weights
from moe_onnx.ranks import ThreadRanks

from .harness import interleaved_seconds

CONFIG = LayerConfig(ranks=4, local_experts=4, top_k=2, hidden=2048, ffn=256, tokens_per_rank=1024, capacity=160)
#: the repository's corpus, beside this package in a source checkout (pip install -e .)
CORPUS = Path(__file__).resolve().parents[1] / "tests" / "data" / "exports"


def forward(models, feeds, executor: str = "split"):
    """One forward of all ranks as threads (sessions and the thread world made once); a
    rank's failure raises :class:`~moe_onnx.ranks.RankFailure`."""
    ranks = ThreadRanks(models, executor=executor)
    return lambda: ranks.run(feeds)


def forward_seconds(models, xs, repeats: int = 5, executor: str = "split") -> float:
    """Median wall time of one forward of all ranks (sessions and threads made once)."""
    medians, _ = interleaved_seconds({"x": forward(models, [{"x": x} for x in xs], executor)}, repeats)
    return medians["x"]


def corpus_rows(corpus: Path, repeats: int = 20) -> list[dict]:
    """Per export (N = 4 of the first corpus, and the later ones): node counts, forward ms, how the
    counts are obtained, batch-specific warnings, max |diff| vs torch on the traced batch."""
    rows = []
    for directory in sorted(d for d in corpus.iterdir() if d.is_dir()):
        if not (directory / "export.json").is_file() and not directory.name.endswith("_n4"):
            continue
        ranks = len(list(directory.glob("rank*.onnx")))
        models = [onnx.load(directory / f"rank{r}.onnx") for r in range(ranks)]
        results = [insert_rerouting(m) for m in models]
        converted = [m for m, _ in results]
        feeds = [dict(np.load(directory / f"rank{r}_inputs.npz")) for r in range(ranks)]
        want = [np.load(directory / f"rank{r}_torch_out.npz")["output"] for r in range(ranks)]
        paths = {"original": forward(models, feeds), "converted": forward(converted, feeds)}
        medians, ratios = interleaved_seconds(paths, repeats, warmup=2)
        outputs = {name: [out[0] for out in run()] for name, run in paths.items()}
        report = results[0][1]
        entries = [e for e in report.entries if e.status == "converted"]
        rows.append(
            {
                "export": directory.name,
                "ranks": ranks,
                "counts": entries[0].counts.split(":")[0].split(" ")[0] if entries else "-",
                "folded": sum(len(e.folded) for e in entries),
                "warned": bool(report.batch_specific),
                "nodes_before": len(models[0].graph.node),
                "nodes_after": len(converted[0].graph.node),
                "original_ms": medians["original"] * 1e3,
                "converted_ms": medians["converted"] * 1e3,
                "ratio": ratios["converted"],
                "bit_identical": all(
                    np.array_equal(a.view(np.uint8), b.view(np.uint8))
                    for a, b in zip(outputs["original"], outputs["converted"])
                ),
                "max_diff_vs_torch": max(
                    float(np.abs(b.astype(np.float64) - w).max()) for b, w in zip(outputs["converted"], want)
                ),
            }
        )
    return rows


def corpus_table(rows: list[dict]) -> str:
    lines = [
        "| export | N | counts | batch-specific | nodes before | nodes after | forward ms before "
        "| forward ms after | after / before | outputs | max abs diff vs torch |",
        "|---|---:|---|---|---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in rows:
        counts = r["counts"] + (" + probs folded" if r["folded"] else "")
        lines.append(
            f"| {r['export']} | {r['ranks']} | {counts} | {'warned' if r['warned'] else '-'} | {r['nodes_before']} "
            f"| {r['nodes_after']} | {r['original_ms']:.2f} | {r['converted_ms']:.2f} | {r['ratio']:.2f}x "
            f"| {'bit-identical' if r['bit_identical'] else 'DIFFER'} | {r['max_diff_vs_torch']:.1e} |"
        )
    return "\n".join(lines)


def ep_layer_table(repeats: int = 5) -> str:
    weights = make_weights(CONFIG, seed=0)
    xs = example_inputs(CONFIG)
    lines = [
        f"EP layer: {CONFIG}",
        "| pattern | nodes before | nodes after | forward ms before | forward ms after "
        "| pyop executor: before | after |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for pattern in PATTERNS:
        models = [build_rank_model(CONFIG, weights, r, pattern) for r in range(CONFIG.ranks)]
        converted = [insert_rerouting(m)[0] for m in models]
        times = [
            forward_seconds(m, xs, repeats, executor=executor) * 1e3
            for executor in ("split", "pyop")
            for m in (models, converted)
        ]
        lines.append(
            f"| {pattern} | {len(models[0].graph.node)} | {len(converted[0].graph.node)} | "
            + " | ".join(f"{t:.1f}" for t in times)
            + " |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("corpus", "ep-layer"))
    parser.add_argument("--corpus", type=Path, default=CORPUS, help="directory of exports (default: the repo's)")
    parser.add_argument("--repeats", type=int, default=20, help="rounds per corpus export (ep-layer: 5)")
    args = parser.parse_args(argv)
    if args.only in (None, "corpus"):
        if not args.corpus.is_dir():
            parser.error(f"no corpus at {args.corpus}: pass --corpus DIR (tests/data/exports of a checkout)")
        print(corpus_table(corpus_rows(args.corpus, args.repeats)))
    if args.only in (None, "ep-layer"):
        print(ep_layer_table())


if __name__ == "__main__":
    main()
