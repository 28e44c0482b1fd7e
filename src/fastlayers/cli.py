"""Command line: ``fastlayers demo``, ``train``, ``bench`` and ``doctor``, ``fastlayers --version``.

It needs the ``cli`` extra (``pip install 'fastlayers[cli]'``: tqdm, rich, matplotlib) and
says so when one is missing. Errors the user can act on (bad settings, missing data, an --out that
cannot be written or holds another run, an unusable checkpoint) end in one line, no traceback.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from collections.abc import Container


def _demo(args: argparse.Namespace) -> int:
    if args.which == "local":
        from .demo import local

        if args.hidden_size is not None:
            raise SystemExit("fastlayers demo local: --hidden-size: the speech demo's option (the local demo's "
                             "models have no hidden size)")
        local.run(local.Config(epochs=args.epochs or local.Config.epochs, seed=args.seed))
        return 0
    from .demo import speech

    speech.run(speech.Config(epochs=args.epochs or speech.Config.epochs,
                             hidden_size=args.hidden_size or speech.Config.hidden_size, seed=args.seed))
    return 0


def _at_least(low: int, below: int | None = None, bound: str = ""):
    """An argparse type: an int >= ``low`` (and < ``below``, written ``bound``; argparse's one-line
    error otherwise)."""
    want = f"an int >= {low}" if below is None else f"an int in [{low}, {bound or below})"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}") from None
        if value < low or below is not None and value >= below:
            raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}")
        return value
    return parse


def _train(args: argparse.Namespace) -> int:
    from .train import TrainConfig, run

    options = {k: v for k, v in vars(args).items() if k not in ("command", "func", "unidirectional")}
    try:
        cfg = TrainConfig(bidirectional=not args.unidirectional, **options)
    except ValueError as e:
        raise SystemExit(f"fastlayers train: {_as_flags(str(e), options)}") from None
    try:  # an --out that cannot be written fails here, not after the first epoch
        cfg.out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=cfg.out):
            pass
    except OSError as e:
        raise SystemExit(f"fastlayers train: --out {cfg.out}: cannot write there ({e.strerror or e})") from None
    run(cfg)
    return 0


def _as_flags(message: str, fields: Container[str], inline: bool = True) -> str:
    """A TrainConfig error in the words of the command line: the fields it names (``epochs: ...``,
    ``resume / overwrite: ...``, ``zoneout[0] (z_h): ...``, with ``inline`` also ``got dropout=0.5``)
    as the flags the user typed (``--epochs: ...``); other words are left alone."""
    def flag(name: str) -> str:
        return "--" + name.replace("_", "-")

    head, sep, rest = message.partition(": ")
    names = [re.fullmatch(r"(\w+)(\[\d+\] \(\w+\))?", part) for part in head.split(" / ")]  # (zoneout[0] (z_h))
    if sep and all(m is not None and m.group(1) in fields for m in names):
        head = " / ".join(flag(m.group(1)) for m in names if m is not None)
    if inline:
        rest = re.sub(r"\b(\w+)=", lambda m: flag(m.group(1)) + "=" if m.group(1) in fields else m.group(), rest)
    return head + sep + rest


def _doctor(args: argparse.Namespace) -> int:
    from ._doctor import report

    print(report())
    return 0


# what the command line needs beyond the layers: the `cli` extra (pyproject.toml)
_CLI_EXTRA = ("tqdm", "rich", "matplotlib")


def _user_error(e: BaseException) -> str | None:
    """The one line to print for an error the user can act on (no traceback), else None."""
    if isinstance(e, ModuleNotFoundError) and (e.name or "").split(".")[0] in _CLI_EXTRA:
        return f"needs {e.name}, which comes with the command line's extra: pip install 'fastlayers[cli]'"
    kinds = [getattr(sys.modules.get(module), name, None) for module, name in (
        ("fastlayers.data._shipped", "DataUnavailable"), ("fastlayers.train._checkpoint", "CheckpointError"),
        ("fastlayers.train._outdir", "OutputInUse"), ("fastlayers.train._distributed", "DeviceUnavailable"),
        ("fastlayers.train._distributed", "LaunchSettingError"),
        ("fastlayers._core.backend", "UnknownBackend"), ("fastlayers._core.backend", "BackendUnavailable"))]
    return str(e) if any(kind is not None and isinstance(e, kind) for kind in kinds) else None


def _every(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1 or 'auto', got {text!r}")
    return value


def _add_train_arguments(p: argparse.ArgumentParser) -> None:
    from .train._config import BATCHINGS, CELLS, DATASETS, HEADS, PRECISIONS, TrainConfig

    d = TrainConfig()
    p.add_argument("--dataset", choices=DATASETS, default=d.dataset,
                   help="digits: Free Spoken Digit Dataset (13 MFCCs, 10 classes); vowels: UCI Japanese Vowels "
                        "(12 LPC coefficients, 9 speakers)")
    p.add_argument("--cell", choices=CELLS, default=d.cell)
    p.add_argument("--hidden-size", type=int, default=d.hidden_size)
    p.add_argument("--num-layers", type=int, default=d.num_layers)
    p.add_argument("--unidirectional", action="store_true", help="one direction (default: bidirectional)")
    p.add_argument("--layer-norm", action="store_true")
    p.add_argument("--peephole", action="store_true", help="LSTM only")
    p.add_argument("--cell-clip", type=float, default=None, help="LSTM only")
    p.add_argument("--zoneout", type=float, default=d.zoneout)
    p.add_argument("--recurrent-dropout", type=float, default=d.recurrent_dropout)
    p.add_argument("--dropout", type=float, default=d.dropout, help="between layers")
    p.add_argument("--head", choices=HEADS, default=d.head, help="final states, or attention pooling over the outputs")
    p.add_argument("--epochs", type=int, default=d.epochs)
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="per process")
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--precision", choices=PRECISIONS, default=d.precision)
    p.add_argument("--batching", choices=BATCHINGS, default=d.batching,
                   help="padded: each batch padded to its longest sequence, with lengths; varlen: the sequences "
                        "concatenated with cu_seqlens, no padding (the same results)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--out", default=str(d.out), help="output directory (default: %(default)s)")
    p.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every, help="steps; 0: at epoch ends only")
    p.add_argument("--keep", type=int, default=d.keep, help="checkpoints kept")
    p.add_argument("--resume", action="store_true", help="continue from the newest loadable checkpoint in --out")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the run that --out holds (its files are removed first); without --resume or "
                        "--overwrite, an --out that holds a run is refused")
    p.add_argument("--rnn-checkpoint-every", type=_every, default=None, metavar="K|auto",
                   help="the encoder's checkpoint_every: keep every K-th state and recompute the steps between in "
                        "the backward (memory for time on long sequences; auto: about sqrt(T / D), D directions, "
                        "longer on CPU for small batches)")
    p.add_argument("--max-samples", type=int, default=None, help="train on N training sequences only, a seeded random subset (quick runs)")
    p.add_argument("--max-steps", type=int, default=None, help="stop after N optimisation steps")
    p.add_argument("--device", choices=["cpu", "cuda"], default=d.device)


def _bench(args: argparse.Namespace) -> int:
    from .bench import _cli

    return _cli.run(args)


def main(argv: list[str] | None = None) -> int:
    from . import __version__

    parser = argparse.ArgumentParser(prog="fastlayers", description="fast, verified layers for PyTorch")
    parser.add_argument("--version", action="version", version=f"fastlayers {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train on real data: 'speech' (BLSTM + lengths on spoken digits, default) "
                                       "or 'local' (LocallyConnected2d on 8x8 digits)")
    demo.add_argument("which", nargs="?", choices=["speech", "local"], default="speech")
    demo.add_argument("--epochs", type=_at_least(1), default=None, help="default: 12 (speech), 40 (local)")
    demo.add_argument("--hidden-size", type=_at_least(1), default=None, help="speech only (default: 64)")
    demo.add_argument("--seed", type=_at_least(0, 2**63, "2**63"), default=0)  # (torch's seeds are 64-bit)
    demo.set_defaults(func=_demo)
    train = sub.add_parser("train", help="train a sequence classifier on real recordings (checkpoints, --resume, "
                                         "torchrun for several processes)")
    _add_train_arguments(train)
    train.set_defaults(func=_train)
    bench = sub.add_parser("bench", help="verified speed comparison on a seed workload")
    from .bench._cli import add_arguments

    add_arguments(bench)
    bench.set_defaults(func=_bench)
    doctor = sub.add_parser("doctor", help="versions, CPU features, the native library, Triton, and the "
                                           "backend each layer uses here")
    doctor.set_defaults(func=_doctor)
    args = parser.parse_args(argv)
    try:
        if args.command != "doctor":  # an unknown FASTLAYERS_BACKEND: one line before any work (doctor reports it)
            from ._core.backend import forced

            forced()
        return args.func(args)
    except Exception as e:
        message = _user_error(e)
        if message is None:
            raise
        if args.command == "train":  # (the device check's "device: ...": --device)
            message = _as_flags(message, vars(args), inline=False)
        raise SystemExit(f"fastlayers {args.command}: {message}") from None


if __name__ == "__main__":
    sys.exit(main())
