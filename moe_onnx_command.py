"""The ``moe-onnx`` console script, outside the ``moe_onnx`` package on purpose.

Importing ``moe_onnx`` (numpy, onnx, the op library) takes a second or more; a Ctrl-C or a
SIGTERM in that second would end the process with a traceback of the import (or, for
SIGTERM, silently). This module is imported first and loads nothing but the standard
library until the signals are in hand, so an interrupt at any moment of a command is one
line and exit 130 (SIGINT) or 143 (SIGTERM), as :mod:`moe_onnx.cli` documents.

Once the command has its exit code, the signals are ignored: the work is done, and an
interrupt during the interpreter's teardown would turn a finished run into a traceback or
a death by signal. After an interrupt, or with rank threads still running
(:func:`moe_onnx.cli.ranks_still_running`), the process ends at once (``os._exit``, streams
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
    """The KeyboardInterrupt in ``error``'s causes (moe_onnx.cli.interrupt_behind, which may
    not have been imported yet)."""
    cause: BaseException | None = error
    for _ in range(16):
        if cause is None or isinstance(cause, KeyboardInterrupt):
            return cause
        cause = cause.__cause__ or cause.__context__
    return None


def main() -> int:
    signal.signal(signal.SIGTERM, _terminated)  # (moe_onnx.cli.main installs its own too)
    cli = None
    try:
        from moe_onnx import cli

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
