"""The ``moe-onnx`` command."""

from __future__ import annotations

import argparse
import sys


def _demo(args) -> int:
    from .demo import rerouting_demo

    return 0 if rerouting_demo(seed=args.seed) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="moe-onnx", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="run the built-in example and check it against numpy")
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(func=_demo)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
