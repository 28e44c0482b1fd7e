"""Command line: ``fastlayers demo`` and ``fastlayers bench``."""

from __future__ import annotations

import argparse
import sys


def _demo(args: argparse.Namespace) -> int:
    if args.which == "local":
        from .demo import local

        local.run(local.Config(epochs=args.epochs or local.Config.epochs, seed=args.seed))
        return 0
    from .demo import speech

    speech.run(speech.Config(epochs=args.epochs or speech.Config.epochs, hidden_size=args.hidden_size, seed=args.seed))
    return 0


def _bench(args: argparse.Namespace) -> int:
    from .bench import _cli

    return _cli.run(args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fastlayers", description="fast, verified layers for PyTorch")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train on real data: 'speech' (BLSTM + lengths on spoken digits, default) "
                                       "or 'local' (LocallyConnected2d on 8x8 digits)")
    demo.add_argument("which", nargs="?", choices=["speech", "local"], default="speech")
    demo.add_argument("--epochs", type=int, default=None, help="default: 12 (speech), 40 (local)")
    demo.add_argument("--hidden-size", type=int, default=64)
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(func=_demo)
    bench = sub.add_parser("bench", help="verified speed comparison on a seed workload")
    from .bench._cli import add_arguments

    add_arguments(bench)
    bench.set_defaults(func=_bench)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
