"""The ``moe-onnx`` command.

Exit codes: 0 done; 1 the run failed (a rank timed out, died, or its collectives did not
match its peers'); 2 what the command was given was refused (a missing or invalid file,
inputs that do not fit the model, an op refusing its inputs: one line, no traceback unless
``--debug``); 124 the MPI watchdog stopped the job; 130 interrupted (SIGINT or SIGTERM).
"""

from __future__ import annotations

import argparse
import sys
import traceback

from .errors import REFUSALS, UserError


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
            return launch.mpi_rank_main(args.model, args.inputs, args.outputs, args.seed, args.timeout, args.debug)
        return launch.run_with_mpi(
            args.model, args.ranks, args.inputs, args.outputs, args.seed, args.timeout, debug=args.debug
        )
    from .ranks import RankFailure

    try:
        launch.run_with_threads(args.model, args.ranks, args.inputs, args.outputs, args.seed, args.timeout)
    except RankFailure as failure:
        for rank, error in sorted(failure.errors.items()):
            print(launch.error_line(rank, error), file=sys.stderr)
            if args.debug:
                traceback.print_exception(type(error), error, error.__traceback__)
        return launch.exit_code(failure.errors)
    return 0


def _convert(args) -> int:
    from .convert import convert_file

    report = convert_file(args.input, args.output, strict=args.strict)
    print(report)
    if args.json:
        report.save_json(args.json)
    return 0


def _lower(args) -> int:
    from .lower_file import lower_file

    model = lower_file(args.input, args.output, inline=args.inline)
    functions = ", ".join(f"{f.name} [{f.overload}]" for f in model.functions if f.domain == "cann.moe")
    if args.inline or functions:
        print(f"wrote {args.output}: " + ("bodies inlined" if args.inline else f"functions {functions}"))
    else:
        print(f"wrote {args.output}: no cann.moe op to lower (collectives stay)")
    return 0


def _bench(args) -> int:
    from . import OPS
    from .benchmarks import suite

    if args.op is not None and args.op not in OPS:
        raise UserError(f"unknown --op {args.op!r}; the ops are {', '.join(sorted(OPS))}")
    rows = suite.run(args.op, args.shape, args.repeats, stock=not args.no_stock)
    if not rows:
        raise UserError(f"no benchmark case runs {args.op}")
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
    parser = argparse.ArgumentParser(
        prog="moe-onnx", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", help="show tracebacks of refused input too")
    commands = parser.add_subparsers(dest="command", required=True)

    def add_command(name: str, **kwargs) -> argparse.ArgumentParser:
        return commands.add_parser(name, parents=[common], **kwargs)

    demo = add_command("demo", help="run the built-in examples and check them against numpy")
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(func=_demo)

    run = add_command("run", help="run a model on N ranks")
    run.add_argument("model", help="model file, directory of rank{r}.onnx, or a path with {r}")
    run.add_argument("--ranks", type=int, required=True)
    run.add_argument("--backend", choices=("threads", "mpi"), default="threads")
    run.add_argument("--inputs", help="per-rank inputs, a path with {r} (e.g. rank{r}.npz)")
    run.add_argument("--outputs", help="directory for rank{r}.npz outputs")
    run.add_argument("--seed", type=int, default=0, help="seed of the generated example batch")
    run.add_argument("--timeout", type=float, default=120.0, help="seconds any rank may wait for another")
    run.add_argument("--rank-process", action="store_true", help=argparse.SUPPRESS)
    run.set_defaults(func=_run)

    convert = add_command("convert", help="insert MoeReRoutingV2 after each AllToAll's chunk sort")
    convert.add_argument("input")
    convert.add_argument("output")
    convert.add_argument("--json", help="also write the report (per all-to-all node) as JSON to this file")
    convert.add_argument("--strict", action="store_true", help="refuse a graph that only holds for its traced batch")
    convert.set_defaults(func=_convert)

    lower = add_command(
        "lower", help="give every cann.moe op but the collectives a body in standard ONNX ops (docs/lowering.md)"
    )
    lower.add_argument("input")
    lower.add_argument("output")
    lower.add_argument("--inline", action="store_true", help="replace the nodes by their bodies (no functions)")
    lower.set_defaults(func=_lower)

    bench = add_command("bench", help="time every op against the memory floor (see benchmarks/)")
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
    try:
        return args.func(args)
    except KeyboardInterrupt as interrupt:
        print(f"moe-onnx {args.command}: interrupted ({interrupt or 'SIGINT'})", file=sys.stderr)
        return 130
    except REFUSALS as refused:
        if args.debug:
            traceback.print_exc()
        print(f"moe-onnx {args.command}: error: {refused}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
