"""The masks the recurrent layers draw in training (zoneout keep-masks, recurrent-dropout masks
before their 1 / keep scale): :func:`keep_mask`, which every engine, cell, operator and the
reference twin call: one mask function per device, each engine drawing in its own layout and
order (:func:`._common.drawn_masks`; the reference step by step), so that one engine draws the same
masks from the same seed with or without gradients, threads or ``checkpoint_every``.

On CPU a mask comes from a counter-based generator (``_native/masks.c``; :func:`counter_mask` is
the same function in torch ops, the fallback without the library and the tests' oracle): one seed
per mask drawn from torch's CPU generator (``torch.manual_seed`` makes a run repeatable), element i
kept when the top 32 bits of splitmix64(seed + (i + 1) * golden ratio) are below round(p * 2^32).
The elements are independent, so the native library's threads split them: torch.rand's CPU
generator runs on one thread: 1.4 ms for a (2, 1600, 128) mask on AMD Zen 4 against 0.1 ms here
(benchmarks/rnn/probe_page_faults.py, issue 62). On other devices, and in programs torch.export
traces (whose translations, ONNX's among them, know torch.rand): ``torch.rand(shape) < p`` (on
CUDA it is fast).
"""

from __future__ import annotations

import ctypes
import math

import torch
from torch import Tensor

from .. import _native
from .._core import pool
from .._core.backend import transformed


def _signed(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN, _MIX1, _MIX2 = (_signed(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))
_SUFFIX = {torch.float32: "f32", torch.float64: "f64"}
_SEED_END = (1 << 63) - 1
_PARALLEL_FROM = 1 << 15  # elements: smaller masks on one thread (the threads' start costs more)


def threshold(p: float) -> int:
    """The 32-bit threshold of keep probability ``p``: round(p * 2^32), in [0, 2^32]."""
    return min(max(round(p * 2.0 ** 32), 0), 1 << 32)


def _srl(z: Tensor, k: int) -> Tensor:
    """Logical right shift of int64 values (torch's >> is arithmetic)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def counter_mask(shape, p: float, seed: Tensor | int, dtype: torch.dtype, device) -> Tensor:
    """The counter-based mask in torch ops (int64 arithmetic wraps as the C kernel's uint64): ones
    where kept (probability ``p``), zeros elsewhere, ``shape`` in C order of the element index."""
    i = torch.arange(1, math.prod(shape) + 1, dtype=torch.int64, device=device)
    z = seed + i * _GOLDEN
    z = (z ^ _srl(z, 30)) * _MIX1
    z = (z ^ _srl(z, 27)) * _MIX2
    z = z ^ _srl(z, 31)
    return (_srl(z, 32) < threshold(p)).to(dtype).view(shape)


def _lib():
    lib = _native.load("masks")
    if lib is None:
        return None
    return _native.declare(lib, "masks", lambda real: {
        "fl_keep_mask": [ctypes.c_int64, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_void_p, ctypes.c_int]})


def _native_mask(shape: tuple[int, ...], p: float, seed: int, dtype: torch.dtype, like: Tensor) -> Tensor:
    """:func:`counter_mask` of the integer ``seed`` on the native library's threads (its torch-ops
    twin where the library is unavailable)."""
    lib = _lib()
    if lib is None:
        return counter_mask(shape, p, seed, dtype, "cpu")
    work = dtype if dtype in _SUFFIX else torch.float32
    out = pool.empty(shape, work, like)
    n = out.numel()
    getattr(lib, f"fl_keep_mask_{_SUFFIX[work]}")(n, seed, threshold(p), out.data_ptr(),
                                                   torch.get_num_threads() if n >= _PARALLEL_FROM else 1)
    return out if work == dtype else out.to(dtype)


@torch.library.custom_op("fastlayers::counter_mask", mutates_args=(), device_types="cpu")
def _counter_mask_op(seed: Tensor, shape: list[int], p: float, dtype: torch.dtype) -> Tensor:
    """The mask of a seed tensor as an operator, for torch.compile: its graph calls the kernel
    instead of compiling the hash (Inductor's code for the twin's int64 products with the
    golden-ratio constant corrupted the heap, torch 2.13 on CPU)."""
    return _native_mask(tuple(shape), p, int(seed), dtype, seed)


@_counter_mask_op.register_fake
def _(seed: Tensor, shape: list[int], p: float, dtype: torch.dtype) -> Tensor:
    return seed.new_empty(shape, dtype=dtype)


def keep_mask(shape, p: float, dtype: torch.dtype, device) -> Tensor:
    """A mask of ones (probability ``p``) and zeros of ``shape`` in ``dtype`` on ``device``: on CPU the
    counter-based generator (module docstring; one seed from torch's CPU generator per mask; while
    torch.compile traces, the same kernel as the operator ``fastlayers::counter_mask``: the same
    masks), elsewhere and while torch.export traces ``torch.rand(shape) < p``. Every mask the
    recurrent layers draw in training comes from here."""
    device = torch.device(device)
    shape = tuple(shape)
    if device.type != "cpu" or torch.compiler.is_exporting():  # (an exported program: ops export can translate)
        return (torch.rand(shape, device=device) < p).to(dtype)
    seed = torch.randint(0, _SEED_END, (), dtype=torch.int64)  # one draw of torch's CPU generator
    if torch.compiler.is_compiling() or type(seed) is not torch.Tensor:  # traced, or fake tensors
        return _counter_mask_op(seed, list(shape), p, dtype)
    if transformed():  # torch.func's wrapped tensors have no data pointer: the torch-ops twin, same masks
        return counter_mask(shape, p, int(seed), dtype, "cpu")
    return _native_mask(shape, p, int(seed), dtype, seed)
