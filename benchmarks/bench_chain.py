"""The split executor's chain step, measured (issue 31): the six-node layer of
:mod:`.bench_layer_e2e` in four sessions that differ only in how much of it runs as one
compiled call (``moe_onnx/runtime/chains.py``), side by side with onnxruntime's MoE::

    python -m moe_onnx.benchmarks.bench_chain [mixtral|qwen3|deepseek ...] [--tokens 1,2,4,16,64]
        [--repeats 31] [--cold] [--json OUT]

* ``node steps``: every node its own step (no chain);
* ``chain of four``: GroupedMatmul -> SwiGlu -> GroupedMatmul -> MoeFinalizeRoutingV2 as one call;
* ``dispatch + chain``: MoeInitRoutingV3 joins it;
* ``gating + dispatch + chain``: MoeGatingTopKSoftmax too (the default session).

The paths run in turn, round after round (medians, and the median per-round ratio to
onnxruntime's MoE). With ``--cold`` a 1 GiB copy runs before every call, so each finds its
weights and the interpreter's state out of the caches (a layer of a model too large for them);
without it each call finds what the previous round left. Every session's y is checked equal,
bit for bit, before timing.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import numpy as np

from .bench_layer_e2e import LayerBench, layer_model, layer_tokens
from .harness import interleaved_seconds
from .presets import DEFAULT_LAYERS, LAYER_SHAPES

#: decode batch sizes, and one past the lane dots' groups
TOKENS = (1, 2, 4, 16, 64)
#: the variants: which chain matchers are turned off while the session is built
VARIANTS = {
    "node steps": ("match",),
    "chain of four": ("match_dispatch",),
    "dispatch + chain": ("match_gating",),
    "gating + dispatch + chain": (),
}


def session_without(shape, matchers: tuple[str, ...]):
    """An InferenceSession of the layer built with ``matchers`` of runtime.chains refusing."""
    import moe_onnx
    from moe_onnx.runtime import chains

    saved = {name: getattr(chains, name) for name in matchers}
    try:
        for name in matchers:
            setattr(chains, name, lambda *args: False)
        return moe_onnx.InferenceSession(layer_model(shape))
    finally:
        for name, matcher in saved.items():
            setattr(chains, name, matcher)


def evictor(enabled: bool) -> Callable[[], None]:
    """A copy of 1 GiB (more than this machine's caches), or nothing."""
    if not enabled:
        return lambda: None
    source = np.ones(1 << 30, np.uint8)
    target = np.empty_like(source)
    return lambda: np.copyto(target, source)


def run(layers: list[str], tokens: list[int], repeats: int, cold: bool) -> list[dict]:
    """One row per layer and T: ms of every path and its ratio to onnxruntime's MoE."""
    between = evictor(cold)
    rows = []
    for name in layers:
        shape = LAYER_SHAPES[name]
        bench = LayerBench(shape, with_torch=False)
        sessions = {variant: session_without(shape, off) for variant, off in VARIANTS.items()}
        for count in tokens:
            feeds = {**layer_tokens(shape, count), **bench.weights}
            # each session twice: the first call at a shape runs the node steps, the second the chain
            ys = [s.run(None, feeds)[0] for s in (*sessions.values(), *sessions.values())]
            if not all(np.array_equal(ys[0].view(np.uint8), y.view(np.uint8)) for y in ys):
                raise AssertionError(f"{name} T={count}: the variants' y differ")
            medians, ratios = interleaved_seconds(_paths(bench, sessions, feeds), repeats, 2, between)
            row = {"layer": name, "T": count, "caches": "cold" if cold else "warm"}
            row |= {f"{path} ms": round(seconds * 1e3, 3) for path, seconds in medians.items()}
            row |= {f"{path} / MoE": round(ratios[path], 2) for path in VARIANTS}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def _paths(bench: LayerBench, sessions: dict, feeds: dict) -> dict[str, Callable]:
    """onnxruntime's MoE first (the ratios' denominator), then the variants, on ``feeds``."""
    ort_feeds = bench.ort_feeds(feeds)
    paths: dict[str, Callable] = {"onnxruntime MoE": lambda: bench.ort_moe.run(None, ort_feeds)}
    for variant, session in sessions.items():
        paths[variant] = lambda session=session: session.run(None, feeds)
    return paths


def markdown_table(rows: list[dict]) -> str:
    """ms of onnxruntime's MoE and of each variant, its ratio to the MoE in brackets."""
    head = "| layer | T | caches | onnxruntime MoE | " + " | ".join(VARIANTS) + " |"
    lines = [head, "|---|---:|---|" + "---:|" * (len(VARIANTS) + 1)]
    for r in rows:
        cells = [f"{r[v + ' ms']:.2f} ({r[v + ' / MoE']:.2f})" for v in VARIANTS]
        lead = f"| {r['layer']} | {r['T']} | {r['caches']} | {r['onnxruntime MoE ms']:.2f} | "
        lines.append(lead + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("layers", nargs="*", choices=[[], *sorted(LAYER_SHAPES)], help="default: the three shapes")
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    parser.add_argument("--repeats", type=int, default=31)
    parser.add_argument("--cold", action="store_true")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    rows = run(args.layers or list(DEFAULT_LAYERS), [int(t) for t in args.tokens.split(",")], args.repeats, args.cold)
    print(markdown_table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
