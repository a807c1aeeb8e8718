"""The moe-onnx command: run, convert, lower, check and bench models with cann.moe operators.

Exit codes: 0 done; 1 the run failed (a rank timed out, died, or its collectives did not
match its peers'), or check found a node the NPU would refuse; 2 what the command was
given was refused (a missing or invalid file or option, inputs that do not fit the model, an
op refusing its inputs: one line, no traceback unless --debug); 124 the MPI watchdog
stopped the job; 130 interrupted by SIGINT (Ctrl-C), 143 by SIGTERM (one line; bench
first writes the rows it finished).

Every option and output path is checked before any work starts. The operators, the commands
and their outputs are described in README.md and docs/ of the source repository.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import threading
import traceback

from .. import __version__
from ..errors import REFUSALS, UserError
from ..interrupts import terminate_interrupts


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a refused option is one line (argparse prints the usage first)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def whole_number(least: int):
    """The argparse type of an int >= ``least`` (``--ranks``, ``--repeats``: 1; ``--seed``: 0)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a whole number >= {least}, got {text!r}") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"must be >= {least}, got {value}")
        return value

    return parse


_count, _seed = whole_number(1), whole_number(0)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text}")
    return value


def _demo(args) -> int:
    from .demo import ep_layer_demo, rerouting_demo

    ok = ep_layer_demo()
    print()
    ok &= rerouting_demo(seed=args.seed)
    return 0 if ok else 1


def _run(args) -> int:
    from ..ranks import rank_files
    from . import launch

    if args.backend == "mpi" and (args.rank_process or launch.in_mpi_job()):
        return launch.mpi_rank_main(
            args.model, args.ranks, args.inputs, args.outputs, args.seed, args.timeout, args.debug
        )
    if args.outputs is not None:
        rank_files.check_output_folder(args.outputs, "--outputs")
    if args.backend == "mpi":
        return launch.run_with_mpi(
            args.model,
            args.ranks,
            args.inputs,
            args.outputs,
            args.seed,
            args.timeout,
            debug=args.debug,
            hostfile=args.hostfile,
            mpiexec_args=args.mpiexec_args,
        )
    if args.hostfile or args.mpiexec_args:
        raise UserError("--hostfile and --mpiexec-args are options of --backend mpi")
    try:
        launch.run_with_threads(args.model, args.ranks, args.inputs, args.outputs, args.seed, args.timeout)
    except launch.ThreadsFailed as failed:
        for line in failed.lines:
            print(line, file=sys.stderr)
        if args.debug:
            for error in failed.errors.values():
                traceback.print_exception(type(error), error, error.__traceback__)
        return failed.code
    return 0


def _fuse(args) -> int:
    from ..ranks.rank_files import check_output_file, make_parent
    from .convert import fuse_model

    if args.json:
        check_output_file(args.json, "--json")
    pending, report = fuse_model(args.input, args.output)
    pending.save()
    print(report)
    if args.json:
        make_parent(args.json)
        report.save_json(args.json)
    return 0


def _inputs(args) -> int:
    from .launch import write_input_templates

    write_input_templates(args.model, args.ranks, args.dir, args.seed)
    return 0


def _pairs(args) -> list[tuple[str, str]]:
    from ..ranks.rank_files import output_pairs

    return output_pairs(args.input, args.output)


def _convert(args) -> int:
    import json

    from ..ranks.rank_files import check_output_file, make_parent
    from .convert import convert_model

    pairs = _pairs(args)
    if args.json:
        check_output_file(args.json, "--json")
    converted = [(source, *convert_model(source, target, strict=args.strict)) for source, target in pairs]
    for _, pending, _ in converted:  # written only once every rank converted
        pending.save()
    for source, pending, report in converted:
        print(report if len(pairs) == 1 else f"{source} -> {pending.target}: {report}")
    notes = sorted({pending.note for _, pending, _ in converted if pending.note})
    for note in notes:  # once, not once per rank
        print(f"note: {note}", file=sys.stderr)
    if args.json:
        make_parent(args.json)
        if len(pairs) == 1:
            converted[0][2].save_json(args.json)
        else:
            ranks = [{"input": s, "output": p.target, "report": r.to_dict()} for s, p, r in converted]
            with open(args.json, "w") as f:
                json.dump(ranks, f, indent=2)
                f.write("\n")
    return 0


def _lower(args) -> int:
    from .lower_file import lower_model, lowered_functions

    pending = [lower_model(source, target, inline=args.inline) for source, target in _pairs(args)]
    for model in pending:  # written only once every rank lowered
        model.save()
    for model in pending:
        functions = ", ".join(lowered_functions(model.target))
        if model.note:
            print(f"wrote {model.target}: {model.note}")
        elif args.inline or functions:
            print(f"wrote {model.target}: " + ("bodies inlined" if args.inline else f"functions {functions}"))
        else:
            print(f"wrote {model.target}: no cann.moe op to lower (collectives stay)")
    return 0


def _shard(args) -> int:
    from .shard_file import shard_file

    print(shard_file(args.input, args.output, args.ranks))
    print(f"wrote {args.output}/rank{{0..{args.ranks - 1}}}.onnx (run: moe-onnx run {args.output})")
    return 0


def _check(args) -> int:
    from ..ranks import rank_files
    from . import launch
    from .npu_check import check_model

    count = rank_files.rank_count(args.model, None)
    paths = [rank_files.rank_path(args.model, r) for r in range(count or 1)]
    chips = args.target or list(TARGETS)
    broken = nodes = 0
    for path in paths:
        verdicts = check_model(launch.check_model(path), chips)
        if len(paths) > 1:
            print(f"{path}:")
        if not verdicts:
            print(f"{'  ' if len(paths) > 1 else ''}no cann.moe node")
        for verdict in verdicts:
            print(("  " if len(paths) > 1 else "") + verdict.line())
            broken += bool(verdict.violations)
            nodes += 1
    print(f"{broken} of {nodes} node-target pair(s) break an NPU limit ({', '.join(chips)})")
    return 1 if broken else 0


def _bench(args) -> int:
    from ..benchmarks import suite

    if args.layer:
        from ..benchmarks import bench_layer_e2e

        if args.op or args.shape or args.no_stock:
            raise UserError("--layer times the whole layer: it takes no --op, --shape or --no-stock")
        return bench_layer_e2e.command(args.layer, args.repeats, args.json, args.markdown, args.plot)
    return suite.command(
        op=args.op,
        shape=args.shape,
        repeats=args.repeats,
        stock=not args.no_stock,
        json_path=args.json,
        markdown_path=args.markdown,
        plot_path=args.plot,
    )


#: the NPU targets of ``moe-onnx check`` (a module that imports nothing: --help stays fast)
from ..custom_ops.chips import TARGETS  # noqa: E402 - beside the command that uses it

MODEL_HELP = "a model file, a folder of rank{r}.onnx files, or a path with {r} (rank r's file)"
OUT_HELP = "a file for one IN file, else a folder (made if missing) or a path with {r}"


def parser() -> argparse.ArgumentParser:
    from ..benchmarks.presets import LAYERS, PRESET_HELP, SHAPES

    top = OneLineParser(prog="moe-onnx", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    top.add_argument("--version", action="version", version=f"moe-onnx {__version__}")
    common = OneLineParser(add_help=False)
    common.add_argument("--debug", action="store_true", help="show tracebacks, of refused input too")
    commands = top.add_subparsers(dest="command", required=True, metavar="COMMAND", help="what to do (COMMAND --help)")

    def add_command(name: str, description: str, **kwargs) -> argparse.ArgumentParser:
        return commands.add_parser(name, parents=[common], help=description, description=description, **kwargs)

    demo = add_command("demo", "run the built-in examples and check them against numpy")
    demo.add_argument("--seed", type=_seed, default=0, help="seed of the rerouting example's counts (default 0)")
    demo.set_defaults(func=_demo)

    run = add_command(
        "run",
        "run a model on N ranks (threads of this process, or MPI processes)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
        "  moe-onnx run my_layer --outputs out/                  # my_layer/rank{r}.onnx as threads\n"
        "  moe-onnx inputs my_layer in/                          # in/rank{r}.npz to edit\n"
        "  moe-onnx run my_layer --backend mpi --inputs in/rank{r}.npz\n"
        "  mpiexec -n 4 moe-onnx run my_layer --backend mpi      # ranks you started join one job",
    )
    run.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    run.add_argument(
        "--ranks",
        type=_count,
        help="number of ranks; default: the rank files found, or 1 for one file without collectives",
    )
    run.add_argument(
        "--backend",
        choices=("threads", "mpi"),
        default="threads",
        help="threads: ranks in this process (default); mpi: one process per rank under mpiexec "
        "(started here, or joining the job when this process is already a rank of mpiexec / srun)",
    )
    run.add_argument(
        "--inputs",
        metavar="PATH",
        help="rank r's feeds: a .npz per rank, keyed by graph input names, PATH with {r} (in/rank{r}.npz); "
        "default: a seeded example batch from the input types (`moe-onnx inputs` writes it for editing)",
    )
    run.add_argument("--outputs", metavar="DIR", help="write rank r's outputs to DIR/rank{r}.npz, keyed by output name")
    run.add_argument("--seed", type=_seed, default=0, help="seed of the generated example batch (default 0)")
    run.add_argument(
        "--timeout", type=_seconds, default=120.0, help="seconds a rank may wait for another (default 120)"
    )
    run.add_argument("--hostfile", metavar="FILE", help="mpi: Open MPI hostfile placing the ranks (passed to mpiexec)")
    run.add_argument(
        "--mpiexec-args",
        metavar="ARGS",
        help='mpi: more mpiexec options as one string, written --mpiexec-args="--bind-to none -x VAR"; '
        "without --hostfile or host options the ranks run here, oversubscribed",
    )
    run.add_argument("--rank-process", action="store_true", help=argparse.SUPPRESS)
    run.set_defaults(func=_run)

    inputs = add_command("inputs", "write each rank's example inputs to DIR/rank{r}.npz, to edit and pass as --inputs")
    inputs.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    inputs.add_argument("dir", metavar="DIR", help="folder for rank{r}.npz (made if missing)")
    inputs.add_argument("--ranks", type=_count, help="number of ranks (default: the rank files found, else 1)")
    inputs.add_argument("--seed", type=_seed, default=0, help="seed of the example batch (default 0)")
    inputs.set_defaults(func=_inputs)

    convert = add_command("convert", "insert MoeReRoutingV2 after each AllToAll's chunk sort (docs/converters.md)")
    convert.add_argument("input", metavar="IN", help=MODEL_HELP)
    convert.add_argument("output", metavar="OUT", help="the converted model: " + OUT_HELP)
    convert.add_argument("--json", metavar="FILE", help="also write the report (per all-to-all node) as JSON to FILE")
    convert.add_argument("--strict", action="store_true", help="refuse a graph that only holds for its traced batch")
    convert.set_defaults(func=_convert)

    fuse = add_command(
        "fuse", "replace each MoE block of a transformers export by the cann.moe chain (docs/transformers.md)"
    )
    fuse.add_argument("input", metavar="IN", help="an ONNX model file (a transformers-5 batched_mm export)")
    fuse.add_argument("output", metavar="OUT", help="the fused model file")
    fuse.add_argument("--json", metavar="FILE", help="also write the report (per MoE block) as JSON to FILE")
    fuse.set_defaults(func=_fuse)

    lower = add_command(
        "lower", "give every cann.moe op but the collectives a body in standard ONNX ops (docs/lowering.md)"
    )
    lower.add_argument("input", metavar="IN", help=MODEL_HELP)
    lower.add_argument("output", metavar="OUT", help="the lowered model: " + OUT_HELP)
    lower.add_argument("--inline", action="store_true", help="replace the nodes by their bodies (no functions)")
    lower.set_defaults(func=_lower)

    shard = add_command(
        "shard", "split a single-device MoE model over N expert-parallel ranks (docs/expert-parallelism.md)"
    )
    shard.add_argument("input", metavar="IN", help="a single-device model file (cann.moe chain MoE layers)")
    shard.add_argument(
        "output", metavar="OUT", help="folder for rank{r}.onnx and its rank{r}.onnx.data (made if missing)"
    )
    shard.add_argument("--ranks", type=_count, required=True, help="number of ranks N (E %% N must be 0)")
    shard.set_defaults(func=_shard)

    check = add_command("check", "list the NPU limits each cann.moe node breaks on an Ascend target (docs/targets.md)")
    check.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    check.add_argument(
        "--target",
        action="append",
        choices=TARGETS,
        help="an Ascend chip (repeatable; default: all of them)",
    )
    check.set_defaults(func=_check)

    bench = add_command(
        "bench",
        "time every op against the memory floor, side by side (docs/bench.md)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=PRESET_HELP,
    )
    bench.add_argument(
        "--op", metavar="OP", help="only this op type (e.g. MoeReRoutingV2; a wrong one lists those with a case)"
    )
    bench.add_argument(
        "--shape", choices=SHAPES, metavar="PRESET", help=f"only this preset ({', '.join(SHAPES)}; see below)"
    )
    bench.add_argument(
        "--layer",
        nargs="?",
        const="all",
        choices=LAYERS,
        metavar="LAYER",
        help="time the whole MoE layer instead (gating -> dispatch -> GroupedMatmul -> SwiGlu -> GroupedMatmul "
        f"-> combine) against onnxruntime's com.microsoft::MoE and the floors: {', '.join(LAYERS)} (default all)",
    )
    bench.add_argument("--repeats", type=_count, default=5, help="timed rounds per case, after one warm-up (default 5)")
    bench.add_argument(
        "--no-stock", action="store_true", help="skip the stock extensions output path (the slowest, most memory)"
    )
    bench.add_argument("--json", metavar="FILE", help="write the rows as JSON (also when interrupted)")
    bench.add_argument("--markdown", metavar="FILE", help="write the table as markdown (also when interrupted)")
    bench.add_argument("--plot", metavar="FILE", help="write a PNG of achieved GB/s vs the floor (needs matplotlib)")
    bench.set_defaults(func=_bench)
    return top


def ranks_still_running() -> bool:
    """Whether rank threads (named ``rank{r}``, see :class:`moe_onnx.ranks.ThreadRanks`) are
    still inside onnxruntime or a kernel, as after an interrupt or a missed deadline. They
    cannot be stopped, and a process exiting under them aborts (``terminate called without
    an active exception``): the process entry points then end with ``os._exit``."""
    others = [t for t in threading.enumerate() if t is not threading.main_thread()]
    return any(t.is_alive() and re.fullmatch(r"rank\d+", t.name) for t in others)


def exit_now(code: int) -> None:
    """End the process with ``code`` at once, our lines flushed (see :func:`ranks_still_running`)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more to say
            pass
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    with terminate_interrupts():  # SIGTERM ends a command as Ctrl-C does: cleanups run, one line
        command = "moe-onnx"
        debug = False
        try:
            args = parser().parse_args(argv)
            command, debug = f"moe-onnx {args.command}", args.debug
            code = args.func(args)
        except KeyboardInterrupt as interrupt:
            code = _interrupted(command, interrupt)
        except BrokenPipeError:  # stdout closed by the reader (`| head`): nothing more to say
            sys.stdout = open(os.devnull, "w")  # (Python flushes stdout at exit)
            code = 141
        except REFUSALS as refused:
            if debug:
                traceback.print_exc()
            print(f"{command}: error: {refused}", file=sys.stderr, flush=True)
            code = 2
        except Exception as error:
            behind = interrupt_behind(error)
            if behind is None:
                raise
            code = _interrupted(command, behind)
    return code


def interrupt_behind(error: BaseException) -> KeyboardInterrupt | None:
    """The KeyboardInterrupt that caused ``error``, if one did: an extension module
    interrupted while it initialises raises ``ImportError: initialization failed`` from it
    (pybind11's module init: onnxruntime, onnx)."""
    seen: set[int] = set()
    cause: BaseException | None = error
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, KeyboardInterrupt):
            return cause
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return None


def _interrupted(command: str, interrupt: KeyboardInterrupt) -> int:
    signal_name = str(interrupt) or "SIGINT"
    print(f"{command}: interrupted ({signal_name})", file=sys.stderr, flush=True)
    return 143 if signal_name == "SIGTERM" else 130


if __name__ == "__main__":
    exit_code = main()
    if ranks_still_running():
        exit_now(exit_code)
    sys.exit(exit_code)
