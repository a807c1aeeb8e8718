"""The ``moe-onnx`` console script, outside the ``moe_onnx`` package on purpose.

Importing ``moe_onnx`` (numpy, onnx, the op library) takes a second or more; a Ctrl-C or a
SIGTERM in that second would end the process with a traceback of the import (or, for
SIGTERM, silently). This module is imported first and loads nothing but the standard
library until the signals are in hand, so an interrupt at any moment of a command is one
line and exit 130 (SIGINT) or 143 (SIGTERM), as :mod:`moe_onnx.commands.cli` documents.

Once the command has its exit code, the signals are ignored: the work is done, and an
interrupt during the interpreter's teardown would turn a finished run into a traceback or
a death by signal. After an interrupt, or with rank threads still running
(:func:`moe_onnx.commands.cli.ranks_still_running`), the process ends at once (``os._exit``, streams
flushed): CPython marks a KeyboardInterrupt that crossed C code (pybind11 runs Python code
through ``PyRun_String``) as unhandled, and would otherwise kill itself with SIGINT at exit
even though the command caught it and printed its line.
"""

from __future__ import annotations

import os
import signal
import sys


def _terminated(signum: int, _frame) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def _interrupted(interrupt: KeyboardInterrupt, command: str = "moe-onnx") -> int:
    name = str(interrupt) or "SIGINT"
    print(f"{command}: interrupted ({name})", file=sys.stderr, flush=True)
    return 143 if name == "SIGTERM" else 130


def _behind(error: BaseException) -> KeyboardInterrupt | None:
    """The KeyboardInterrupt in ``error``'s causes (moe_onnx.commands.cli.interrupt_behind, which may
    not have been imported yet)."""
    cause: BaseException | None = error
    for _ in range(16):
        if cause is None or isinstance(cause, KeyboardInterrupt):
            return cause
        cause = cause.__cause__ or cause.__context__
    return None


#: the options that only print (help, the version) and so need no op library
_PRINTING = ("-h", "--help", "--version")
#: the packages whose ``__init__`` the printing options skip (they import onnx and the op
#: library: 1-3 s); their modules the parser reads (cli, errors, chips, presets) import nothing heavy
_SKIPPED = ("moe_onnx", "moe_onnx.custom_ops")


def _print_only(argv: list[str]) -> int | None:
    """``--help`` / ``--version`` (of the command or of a subcommand) in a fraction of a
    second: :mod:`moe_onnx.commands.cli`'s parser built with the packages' ``__init__`` skipped, so
    neither onnx nor numpy is imported. None (and nothing loaded) when ``argv`` asks for more
    than that, or when argparse finds no such option to act on."""
    if not any(arg in _PRINTING for arg in argv) or "--" in argv:
        return None
    import importlib.metadata
    import importlib.util

    for name in _SKIPPED:
        spec = importlib.util.find_spec(name)
        if spec is None:
            return None
        sys.modules[name] = importlib.util.module_from_spec(spec)  # __path__ set, __init__ not run
    sys.modules["moe_onnx"].__version__ = importlib.metadata.version("moe-onnx")  # (the same, from pyproject)
    try:
        from moe_onnx.commands import cli as light_cli

        light_cli.parser().parse_args(argv)  # prints and exits on -h, --help, --version
    except SystemExit as done:
        return done.code if isinstance(done.code, int) else 0 if done.code is None else 2
    finally:
        for name in [m for m in sys.modules if m == "moe_onnx" or m.startswith("moe_onnx.")]:
            del sys.modules[name]  # the real packages load as usual if the command goes on
    return None


#: the signals an interrupt arrives by
_HELD = (signal.SIGINT, signal.SIGTERM)


def _import_cli():
    """``moe_onnx.commands.cli`` imported with SIGINT and SIGTERM held: a KeyboardInterrupt raised while
    a native extension initialises (onnx's nanobind module, ml_dtypes) is not always an
    ImportError: nanobind may call ``std::terminate`` and abort the process. So a signal that
    arrives during the import is only noted, and raised once the import is over."""
    arrived: list[int] = []
    held = {signum: signal.signal(signum, lambda signum, _frame: arrived.append(signum)) for signum in _HELD}
    try:
        from moe_onnx.commands import cli
    finally:
        for signum, handler in held.items():
            signal.signal(signum, handler)
    if arrived:
        raise KeyboardInterrupt(signal.Signals(arrived[0]).name)
    return cli


def main() -> int:
    signal.signal(signal.SIGTERM, _terminated)  # (moe_onnx.commands.cli.main installs its own too)
    cli = None
    try:
        printed = _print_only(sys.argv[1:])
        if printed is not None:
            return printed
        cli = _import_cli()
        code = cli.main()
    except KeyboardInterrupt as interrupt:  # while importing, or right after the command
        code = _interrupted(interrupt)
    except ImportError as error:  # an extension interrupted while it initialised (pybind11)
        interrupt = _behind(error)
        if interrupt is None:
            raise
        code = _interrupted(interrupt)
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, signal.SIG_IGN)
    if code in (130, 143) or (cli is not None and cli.ranks_still_running()):
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # a closed pipe: nothing more to say
                pass
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
