"""Command line: ``fastlayers demo``."""

from __future__ import annotations

import argparse
import sys


def _demo(args: argparse.Namespace) -> int:
    from .demo import speech

    cfg = speech.Config(epochs=args.epochs, hidden_size=args.hidden_size, seed=args.seed)
    speech.run(cfg)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fastlayers", description="fast, verified layers for PyTorch")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a BLSTM on real spoken digits (padded batch + lengths)")
    demo.add_argument("--epochs", type=int, default=12)
    demo.add_argument("--hidden-size", type=int, default=64)
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(func=_demo)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
