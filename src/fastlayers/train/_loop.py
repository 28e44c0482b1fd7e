"""The training loop of ``fastlayers train``: epochs of batches (padded, or varlen), metrics, checkpoints, curves."""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from .._core import backend as _backend
from .._core.files import write_atomic
from .._core.system import cpu_name
from ..data import batches, concat_batch, pad_batch
from . import _distributed, _outdir
from ._checkpoint import CheckpointError, listify, load_latest, rng_state, save_checkpoint, set_rng_state
from ._config import TrainConfig
from ._data import Splits, epoch_order, load_splits
from ._model import SequenceClassifier


def _autocast(cfg: TrainConfig, device: torch.device):
    return torch.autocast(device.type, dtype=torch.bfloat16) if cfg.precision == "bf16" else contextlib.nullcontext()


def model_inputs(cfg: TrainConfig, data, idx: list[int], device: torch.device) -> tuple[tuple, dict, torch.Tensor]:
    """(positional, keyword arguments of the model, labels) of one batch, as ``cfg.batching`` says:
    padded (x (B, T, F), lengths) or varlen (x (N, F), cu_seqlens=)."""
    if cfg.batching == "varlen":
        x, cu_seqlens, y = concat_batch(data, idx, device)
        return (x,), {"cu_seqlens": cu_seqlens}, y
    x, lengths, y = pad_batch(data, idx, device)
    return (x, lengths), {}, y


def evaluate(model: nn.Module, data, cfg: TrainConfig, device: torch.device) -> tuple[float, float]:
    """(mean cross-entropy, accuracy) of ``model`` on a whole split, in eval mode."""
    model.eval()
    loss = correct = 0.0
    with torch.no_grad():
        for idx in batches(list(range(len(data.features))), 256):
            args, kwargs, y = model_inputs(cfg, data, idx, device)
            with _autocast(cfg, device):
                logits = model(*args, **kwargs).float()
            loss += F.cross_entropy(logits, y, reduction="sum").item()
            correct += (logits.argmax(1) == y).sum().item()
    model.train()
    n = len(data.features)
    return loss / n, correct / n


def plot_curves(history: list[dict[str, Any]], path: Path, title: str) -> None:
    """loss and accuracy per epoch (train, validation) as a PNG, written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = [h["epoch"] for h in history]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
    for key, label in (("train", "train"), ("val", "validation")):
        ax_loss.plot(epochs, [h[f"{key}_loss"] for h in history], marker="o", label=label)
        ax_acc.plot(epochs, [100 * h[f"{key}_accuracy"] for h in history], marker="o", label=label)
    ax_loss.set(xlabel="epoch", ylabel="cross-entropy", title="loss")
    ax_acc.set(xlabel="epoch", ylabel="accuracy (%)", title="accuracy")
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    try:
        write_atomic(path, lambda f: fig.savefig(f, format="png", dpi=110))
    finally:
        plt.close(fig)


class _Run:
    """State of one process's run: model, optimiser, scheduler, position and metrics."""

    def __init__(self, cfg: TrainConfig, procs: _distributed.Processes, splits: Splits, log: Callable) -> None:
        self.cfg, self.procs, self.splits, self.log = cfg, procs, splits, log
        torch.manual_seed(cfg.seed)  # the same initial weights in every process
        self.model = SequenceClassifier(cfg, splits.num_features, splits.num_classes).to(procs.device)
        self.net = nn.parallel.DistributedDataParallel(self.model) if procs.world > 1 else self.model
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr)
        self.steps_per_epoch = len(batches(epoch_order(len(splits.train.features), 0, cfg.seed, procs.rank, procs.world),
                                           cfg.batch_size))
        self.sched = torch.optim.lr_scheduler.CosineAnnealingLR(self.opt, T_max=self.steps_per_epoch * cfg.epochs)
        torch.manual_seed(cfg.seed + 1 + procs.rank)  # dropout / zoneout masks: one stream per process
        self.progress: dict[str, Any] = {"epoch": 0, "step_in_epoch": 0, "global_step": 0, "sums": [0.0, 0.0, 0.0],
                                         "history": [], "seconds": 0.0, "checkpoints": []}

    def payload(self) -> dict[str, Any]:
        """What a checkpoint holds: rank 0's progress, and each process's RNG state and running
        sums of the epoch's metrics (``rank_sums``: its own share of the batches)."""
        rngs, sums = [rng_state()], [self.progress["sums"]]
        if self.procs.world > 1:
            rngs, sums = [None] * self.procs.world, [None] * self.procs.world
            torch.distributed.all_gather_object(rngs, rng_state())
            torch.distributed.all_gather_object(sums, self.progress["sums"])
        return {"config": self.cfg.to_json(), "model": self.model.state_dict(), "optimizer": self.opt.state_dict(),
                "scheduler": self.sched.state_dict(), "rng": rngs, "progress": self.progress, "rank_sums": sums,
                "world_size": self.procs.world}

    def checkpoint(self) -> None:
        payload = self.payload()  # every process takes part (RNG states are gathered)
        if self.procs.main:
            save_checkpoint(self.cfg.out / "checkpoints", self.progress["global_step"], payload, self.cfg.keep,
                            self.progress.setdefault("checkpoints", []))
        _distributed.barrier(self.procs)

    def resume(self) -> None:
        found = load_latest(self.cfg.out / "checkpoints", warn=self.log)
        if found is None:
            self.log(f"resume: no checkpoint in {self.cfg.out / 'checkpoints'}, starting from the beginning")
            return
        path, payload = found
        ours = self.cfg.run_defining_json()
        theirs = {k: listify(payload["config"].get(k)) for k in ours}  # (as config.json reads back)
        differ = {k: (theirs[k], ours[k]) for k in ours if theirs[k] != ours[k]}
        if differ:
            raise CheckpointError(f"{path}: written by a run with other settings (checkpoint vs now: {differ}); "
                                  f"resume with the same settings or use another --out")
        if payload["world_size"] != self.procs.world:
            raise CheckpointError(f"{path}: written by {payload['world_size']} process(es), resuming with "
                                  f"{self.procs.world}: the data order would differ")
        self.model.load_state_dict(payload["model"])
        self.opt.load_state_dict(payload["optimizer"])
        self.sched.load_state_dict(payload["scheduler"])
        set_rng_state(payload["rng"][self.procs.rank])
        self.progress = payload["progress"]
        if "rank_sums" in payload:  # (checkpoints of earlier releases hold rank 0's sums only)
            self.progress["sums"] = payload["rank_sums"][self.procs.rank]
        self.log(f"resumed from {path}: epoch {self.progress['epoch'] + 1}, step {self.progress['global_step']}")

    def stopped(self) -> bool:
        """max_steps optimisation steps have run (in all, across resumes)."""
        return self.cfg.max_steps is not None and self.progress["global_step"] >= self.cfg.max_steps

    def train_epoch(self, epoch: int) -> bool:
        """Run the rest of ``epoch``, up to max_steps; True when every batch of it has run (then
        :meth:`end_epoch` follows). Stopped early by max_steps, it checkpoints where it stopped."""
        cfg, p = self.cfg, self.progress
        order = batches(epoch_order(len(self.splits.train.features), epoch, cfg.seed, self.procs.rank, self.procs.world),
                        cfg.batch_size)
        bar = tqdm(total=len(order), initial=p["step_in_epoch"], desc=f"epoch {epoch + 1}/{cfg.epochs}", leave=False,
                   disable=not self.procs.main or None)
        start = time.perf_counter()
        saved = True  # the last step that ran is in a checkpoint
        try:
            for idx in order[p["step_in_epoch"]:]:
                if self.stopped():  # (checked before a step: a resumed run at max_steps runs none)
                    break
                args, kwargs, y = model_inputs(cfg, self.splits.train, idx, self.procs.device)
                with _autocast(cfg, self.procs.device):
                    logits = self.net(*args, **kwargs).float()
                loss = F.cross_entropy(logits, y)
                self.opt.zero_grad(set_to_none=True)
                loss.backward()
                self.opt.step()
                self.sched.step()
                p["sums"] = [p["sums"][0] + loss.item() * len(idx), p["sums"][1] + (logits.argmax(1) == y).sum().item(),
                             p["sums"][2] + len(idx)]
                p["step_in_epoch"] += 1
                p["global_step"] += 1
                bar.update(1)
                bar.set_postfix(loss=f"{loss.item():.3f}")
                saved = bool(cfg.checkpoint_every) and p["global_step"] % cfg.checkpoint_every == 0
                if saved:
                    p["seconds"] += time.perf_counter() - start
                    start = time.perf_counter()
                    self.checkpoint()
        finally:
            bar.close()
        p["seconds"] += time.perf_counter() - start
        complete = p["step_in_epoch"] == len(order)
        if not complete and not saved:
            self.checkpoint()  # stopped by max_steps: where --resume continues
        return complete

    def end_epoch(self, epoch: int) -> None:
        cfg, p = self.cfg, self.progress
        loss_sum, correct, n = _distributed.all_sum(self.procs, p["sums"])
        val_loss, val_acc = evaluate(self.model, self.splits.val, cfg, self.procs.device)
        row = {"epoch": epoch + 1, "step": p["global_step"], "train_loss": loss_sum / n, "train_accuracy": correct / n,
               "val_loss": val_loss, "val_accuracy": val_acc, "lr": self.sched.get_last_lr()[0],
               "seconds": round(p["seconds"], 3)}
        p["history"].append(row)
        p.update(epoch=epoch + 1, step_in_epoch=0, sums=[0.0, 0.0, 0.0])
        self.log(f"epoch {epoch + 1}/{cfg.epochs}: train loss {row['train_loss']:.4f} acc {row['train_accuracy']:.2%} | "
                 f"val loss {val_loss:.4f} acc {val_acc:.2%} | lr {row['lr']:.2e} | {p['seconds']:.1f} s")
        if self.procs.main:
            lines = "".join(json.dumps(h) + "\n" for h in p["history"]).encode()
            write_atomic(cfg.out / "metrics.jsonl", lambda f: f.write(lines))
            plot_curves(p["history"], cfg.out / "curves.png", _title(cfg))
        self.checkpoint()


def _title(cfg: TrainConfig) -> str:
    opts = [k for k in ("layer_norm", "peephole") if getattr(cfg, k)]
    opts += [f"{k}={getattr(cfg, k)}" for k in ("cell_clip", "zoneout", "recurrent_dropout", "dropout") if getattr(cfg, k)]
    return (f"{cfg.dataset}: {'bi' if cfg.bidirectional else ''}{cfg.cell.upper()} {cfg.num_layers}x{cfg.hidden_size}"
            f"{' ' + ', '.join(opts) if opts else ''}, {cfg.head} head, {cfg.precision}")


def run(cfg: TrainConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Train as ``cfg`` says (one process, or one of several under torchrun); returns the summary
    (also written to ``cfg.out / "summary.json"`` by rank 0)."""
    procs = _distributed.start(cfg.device)
    say = log if procs.main else (lambda message: None)
    try:
        with contextlib.ExitStack() as stack:
            refused = None
            if procs.main:  # one lock per --out, held by rank 0; every process learns whether it got it
                try:
                    stack.enter_context(_outdir.exclusive(cfg.out))
                except _outdir.OutputInUse as e:
                    refused = e
            if _distributed.all_sum(procs, [float(refused is not None)])[0]:  # (None off rank 0)
                raise refused or _outdir.OutputInUse(f"--out {cfg.out}: another fastlayers train run is using it")
            return _run(cfg, procs, say)
    finally:
        _distributed.stop()


def _check_backend(cfg: TrainConfig, device: torch.device) -> None:
    """A backend forced by ``FASTLAYERS_BACKEND`` that is unknown, or cannot run the run's layers on
    its device, refuses the run here, before anything in ``--out`` changes (not at the first step):
    :func:`fastlayers._core.backend.select`'s UnknownBackend / BackendUnavailable."""
    probe = torch.empty(0, device=device)
    for op in (cfg.cell, *(("attention",) if cfg.head == "attention" else ())):
        _backend.select(op, probe)


def _run(cfg: TrainConfig, procs: _distributed.Processes, say: Callable[[str], None]) -> dict[str, Any]:
    state = None
    try:
        replaced = _outdir.check(cfg.out, cfg.resume, cfg.overwrite, cfg.run_defining_json())  # every process, before any writes
        # everything that can refuse the run (data, model, the checkpoint to resume) before out changes:
        # a run that cannot start leaves the earlier run's files as they were
        _check_backend(cfg, procs.device)
        splits = load_splits(cfg.dataset, cfg.seed, cfg.max_samples)
        state = _Run(cfg, procs, splits, say)
        if cfg.resume:
            state.resume()
        _distributed.barrier(procs)
        if procs.main:
            if replaced:
                _outdir.remove(replaced)
                say(f"--overwrite: removed the earlier run's {len(replaced)} file(s) from {cfg.out}")
            _outdir.remove(_outdir.unfinished_writes(cfg.out))  # left by a process killed mid-write
            cfg.out.mkdir(parents=True, exist_ok=True)
            write_atomic(cfg.out / "config.json", lambda f: f.write(json.dumps(cfg.to_json(), indent=2).encode()))
        say(f"{_title(cfg)}: {len(splits.train.features)} train / {len(splits.val.features)} validation / "
            f"{len(splits.test.features)} test sequences, {state.steps_per_epoch} steps per epoch, "
            f"{procs.world} process(es), torch {torch.__version__}, {torch.get_num_threads()} threads")
        for epoch in range(state.progress["epoch"], cfg.epochs):
            if state.stopped() or not state.train_epoch(epoch):
                break
            state.end_epoch(epoch)
        test_loss, test_acc = evaluate(state.model, splits.test, cfg, procs.device)
        summary = {"test_accuracy": test_acc, "test_loss": test_loss, "epochs_done": state.progress["epoch"],
                   "steps": state.progress["global_step"], "train_seconds": round(state.progress["seconds"], 3),
                   "processes": procs.world, "torch": torch.__version__, "threads": torch.get_num_threads(),
                   "cpu": cpu_name(), "config": cfg.to_json()}
        say(f"test: loss {test_loss:.4f}, accuracy {test_acc:.2%} ({len(splits.test.features)} sequences); "
            f"training {state.progress['seconds']:.1f} s")
        if procs.main:
            weights = state.model.state_dict()
            write_atomic(cfg.out / "model.pt", lambda f: torch.save(weights, f))
            write_atomic(cfg.out / "summary.json", lambda f: f.write(json.dumps(summary, indent=2).encode()))
        return summary
    finally:
        if state is not None:
            state.net = None  # the DDP wrapper goes before the process group (see _distributed.stop)
        del state
