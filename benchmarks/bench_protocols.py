"""The decode layer against onnxruntime's MoE under two timing protocols, side by side (issue 31):

    python -m moe_onnx.benchmarks.bench_protocols [mixtral|qwen3|deepseek|tiny ...] [--tokens 1,2,4,16]
        [--repeats 9] [--json OUT]

What a ratio says depends on what each call finds when it starts: another path's threads
still polling or spinning on the cores (onnxruntime's idle pool threads spin ~25 ms after a
run with its default options; ours poll up to 300 us), or its own threads awake. The layer of
:mod:`.bench_layer_e2e` (the same weights and tokens) is timed as

* ``interleaved``: ``bench_layer_e2e``'s protocol, the session and ``com.microsoft::MoE`` with
  spinning off (``session.intra_op.allow_spinning`` 0) called in turn, round after round, each
  call right after the other path's;
* ``steady``: a 50 ms sleep (longer than any idle spin), two untimed calls of the same path,
  then the timed one: each path in the state a loop over the layer (a decode) keeps it in, with
  onnxruntime's MoE also at its default options (spinning), as users run it.

Every ratio is onnxruntime's time over the session's (above 1: the session is faster), the
median of the per-round ratios.
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

from .bench_layer_e2e import LayerBench, layer_tokens, ort_moe_model
from .harness import interleaved_seconds, steady_seconds
from .presets import DEFAULT_LAYERS, LAYER_SHAPES

TOKENS = (1, 2, 4, 16)


def measure(bench: LayerBench, default_moe, tokens: int, repeats: int) -> dict:
    """One row: each protocol's medians (ms) and onnxruntime / session ratios."""
    feeds = {**layer_tokens(bench.shape, tokens), **bench.weights}
    ort_feeds = bench.ort_feeds(feeds)
    session = functools.partial(bench.session.run, None, feeds)
    quiet = functools.partial(bench.ort_moe.run, None, ort_feeds)
    default = functools.partial(default_moe.run, None, ort_feeds)
    interleaved, to_session = interleaved_seconds({"session": session, "MoE quiet": quiet}, repeats)
    steady, steady_to_session = steady_seconds(
        {"session": session, "MoE quiet": quiet, "MoE default": default}, repeats
    )
    return {
        "layer": bench.shape.name,
        "T": tokens,
        "interleaved ms": {k: 1e3 * v for k, v in interleaved.items()},
        "interleaved MoE quiet / session": to_session["MoE quiet"],
        "steady ms": {k: 1e3 * v for k, v in steady.items()},
        "steady MoE quiet / session": steady_to_session["MoE quiet"],
        "steady MoE default / session": steady_to_session["MoE default"],
    }


def markdown_table(rows: list[dict]) -> str:
    lines = [
        "| layer | T | interleaved: session / MoE quiet ms | MoE quiet / session "
        "| steady: session / MoE quiet / MoE default ms | MoE quiet / session | MoE default / session |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        a, b = r["interleaved ms"], r["steady ms"]
        lines.append(
            f"| {r['layer']} | {r['T']} | {a['session']:.2f} / {a['MoE quiet']:.2f} "
            f"| {r['interleaved MoE quiet / session']:.2f} "
            f"| {b['session']:.2f} / {b['MoE quiet']:.2f} / {b['MoE default']:.2f} "
            f"| {r['steady MoE quiet / session']:.2f} | {r['steady MoE default / session']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    import onnxruntime as ort

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("layers", nargs="*", metavar="LAYER", help=f"{', '.join(LAYER_SHAPES)}")
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    rows = []
    for name in args.layers or DEFAULT_LAYERS:
        shape = LAYER_SHAPES[name]
        bench = LayerBench(shape, with_torch=False)
        default_moe = ort.InferenceSession(ort_moe_model(shape).SerializeToString(), providers=["CPUExecutionProvider"])
        for tokens in (int(t) for t in args.tokens.split(",")):
            rows.append(measure(bench, default_moe, tokens, args.repeats))
            print(markdown_table(rows[-1:]).splitlines()[-1], flush=True)
    print(markdown_table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2), encoding="utf-8")
    return rows


if __name__ == "__main__":
    main()
