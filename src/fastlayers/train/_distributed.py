"""Several processes with torch.distributed: started by ``torchrun``, read from its environment.

``torchrun --nproc_per_node=N -m fastlayers.cli train ...`` sets RANK, LOCAL_RANK and WORLD_SIZE;
each process then joins the default process group (gloo on CPU, nccl on CUDA), trains a
DistributedDataParallel copy of the model on its share of every epoch (DistributedSampler
order) and only rank 0 writes files. Without those variables (or WORLD_SIZE=1) it is one process.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


class DeviceUnavailable(RuntimeError):
    """The run's device is not available here (``device="cuda"`` without a usable GPU)."""


@dataclass(frozen=True)
class Processes:
    rank: int
    world: int
    device: torch.device

    @property
    def main(self) -> bool:
        """The process that writes checkpoints, metrics and plots."""
        return self.rank == 0


class LaunchSettingError(ValueError):
    """A torchrun environment variable (WORLD_SIZE, RANK, LOCAL_RANK) that is not what torchrun sets."""


def _env_int(name: str, default: int, least: int) -> int:
    """torchrun's ``name``, an int >= ``least``, or ``default`` where it is not set."""
    value = os.environ.get(name, "").strip()
    try:
        number = int(value) if value else default
    except ValueError:
        number = least - 1
    if number < least:
        raise LaunchSettingError(f"environment variable {name}: expected an int >= {least} (torchrun sets it), got "
                                 f"{value!r}")
    return number


def start(device: str) -> Processes:
    """Join the process group when torchrun started several processes; pick this process's device."""
    world, rank, local = _env_int("WORLD_SIZE", 1, 1), _env_int("RANK", 0, 0), _env_int("LOCAL_RANK", 0, 0)
    if device == "cuda":
        if not torch.cuda.is_available():
            raise DeviceUnavailable("device: 'cuda' requested, but torch.cuda.is_available() is False")
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
    else:
        dev = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device == "cuda" else "gloo")
    return Processes(rank, world, dev)


def stop() -> None:
    """Destroy the process group, after every DistributedDataParallel wrapper is gone.

    The caller drops its wrappers first and this collects the reference cycles that keep a dropped
    one alive (a DDP module and its Reducer are in cycles), so the group is destroyed here, where
    its destructor releases the GIL and waits for gloo's worker threads to free their last work
    items. Left to the interpreter's exit instead, either the destructor runs with the GIL held
    and waits for a worker that needs the GIL (a hang, pytorch/pytorch#56297), or a worker frees a
    work item (its saved thread-local state holds Python objects) while the interpreter finalizes:
    that thread is ended inside a noexcept destructor and the process aborts with "terminate called
    without an active exception" (about 1 run in 4 of this project's two-process test, also with
    torch.nn.LSTM alone; 0 in 60 with the collection)."""
    if dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


def barrier(procs: Processes) -> None:
    if procs.world > 1:
        dist.barrier()


def all_sum(procs: Processes, values: list[float]) -> list[float]:
    """Sum of ``values`` over all processes (float64; the values themselves with one process)."""
    if procs.world == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=procs.device if procs.device.type == "cuda" else "cpu")
    dist.all_reduce(t)
    return t.tolist()
