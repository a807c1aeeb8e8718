"""The ``moe-onnx`` command."""

from __future__ import annotations

import argparse
import sys


def _demo(args) -> int:
    from .demo import ep_layer_demo, rerouting_demo

    ok = ep_layer_demo()
    print()
    ok &= rerouting_demo(seed=args.seed)
    return 0 if ok else 1


def _run(args) -> int:
    from . import launch

    if args.backend == "mpi":
        if args.rank_process:
            return launch.mpi_rank_main(args.model, args.inputs, args.outputs, args.seed, args.timeout)
        return launch.run_with_mpi(args.model, args.ranks, args.inputs, args.outputs, args.seed, args.timeout)
    from .ranks import RankFailure

    try:
        launch.run_with_threads(args.model, args.ranks, args.inputs, args.outputs, args.seed, args.timeout)
    except RankFailure as failure:
        for rank, error in sorted(failure.errors.items()):
            print(f"rank {rank}: error: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    return 0


def _convert(args) -> int:
    from .convert import convert_file

    report = convert_file(args.input, args.output)
    print(report)
    return 0


def _lower(args) -> int:
    from .lower_file import lower_file

    model = lower_file(args.input, args.output, inline=args.inline)
    functions = ", ".join(f"{f.name} [{f.overload}]" for f in model.functions if f.domain == "cann.moe")
    print(f"wrote {args.output}: " + (f"functions {functions}" if functions else "bodies inlined"))
    return 0


def _bench(args) -> int:
    from .benchmarks import suite

    rows = suite.run(args.op, args.shape, args.repeats, stock=not args.no_stock)
    table = suite.markdown(rows)
    print("\n" + table)
    if args.json:
        suite.save_json(rows, args.json)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table + "\n")
    if args.plot:
        suite.plot(rows, args.plot)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="moe-onnx", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    demo = commands.add_parser("demo", help="run the built-in examples and check them against numpy")
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(func=_demo)

    run = commands.add_parser("run", help="run a model on N ranks")
    run.add_argument("model", help="model file, directory of rank{r}.onnx, or a path with {r}")
    run.add_argument("--ranks", type=int, required=True)
    run.add_argument("--backend", choices=("threads", "mpi"), default="threads")
    run.add_argument("--inputs", help="per-rank inputs, a path with {r} (e.g. rank{r}.npz)")
    run.add_argument("--outputs", help="directory for rank{r}.npz outputs")
    run.add_argument("--seed", type=int, default=0, help="seed of the generated example batch")
    run.add_argument("--timeout", type=float, default=120.0, help="seconds any rank may wait for another")
    run.add_argument("--rank-process", action="store_true", help=argparse.SUPPRESS)
    run.set_defaults(func=_run)

    convert = commands.add_parser("convert", help="insert MoeReRoutingV2 after each AllToAll's chunk sort")
    convert.add_argument("input")
    convert.add_argument("output")
    convert.set_defaults(func=_convert)

    lower = commands.add_parser(
        "lower", help="give every cann.moe op but the collectives a body in standard ONNX ops (docs/lowering.md)"
    )
    lower.add_argument("input")
    lower.add_argument("output")
    lower.add_argument("--inline", action="store_true", help="replace the nodes by their bodies (no functions)")
    lower.set_defaults(func=_lower)

    bench = commands.add_parser("bench", help="time every op against the memory floor (see benchmarks/)")
    bench.add_argument("--op", help="only this op type")
    bench.add_argument(
        "--shape",
        choices=("seed", "deepseek-v3", "qwen3-235b", "mixtral", "tiny"),
        help="only this preset (default: all but tiny)",
    )
    bench.add_argument("--repeats", type=int, default=5)
    bench.add_argument("--no-stock", action="store_true", help="skip the (slow) stock output path")
    bench.add_argument("--json", help="write the rows as JSON")
    bench.add_argument("--markdown", help="write the table as markdown")
    bench.add_argument("--plot", help="write a PNG of achieved GB/s vs the floor")
    bench.set_defaults(func=_bench)

    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
