"""Issue: GPU kernels verified without a GPU — every Triton kernel the layers launch, compiled for the
H100 (sm_90a) and the A100 (sm_80) on a machine without a GPU, with what ptxas says of each.

The layers run on CPU tensors with the ``triton`` backend forced and a compile-only Triton driver
(no CUDA driver needed): every launch goes through Triton's own binder, so it compiles exactly the
specialization a GPU launch would (dtypes, constexprs, divisibility of pointers and integers),
and nothing is launched (``JITFunction.run(..., warmup=True)``; the outputs stay uninitialised,
which the layers' host code does not read). For every distinct compiled kernel: registers, spill
stores / loads and stack from the bundled ``ptxas -v``, shared memory from the kernel's metadata,
the programs of its grid at the workload's shape (the seed shapes: T=16 keeps every specialization
of T=800, see shared/reference/gpu-static.md) and the occupancy that allows on one SM; and for
every workload (an option set) the wall time of its first call, which is the compile time of its
kernels (a fresh Triton cache per workload). For the recurrent step kernels with lengths: how many
global loads wait for their load of len_b (a def-use walk over the PTX), which must be none.

Each recurrent workload runs its loops eagerly at T=16, then as captured chunks of steps at T=13
(``fastlayers.rnn._gpu_graphs.emulated``: the chunk's launches, with their step offsets and the
buffers' larger time capacity, compile as a replay on the GPU would launch them).

Fails (exit 1) on a compile error, a float32 / bfloat16 kernel that spills more than 16 bytes (more
than SPILL_ALLOWED's figure for the kernels measured faster with spills), a
recurrent step kernel with a load that waits for len_b (or without its load of len_b), or a
kernel with an atomic instruction in its PTX (``atom.`` / ``red.``: every gradient sums in a fixed
order, so training repeats bit for bit under torch.use_deterministic_algorithms), or a
recurrent step kernel or step GEMM configuration compiled more than once (one compile per
configuration: the step, T and the time capacity are data, not specialisations).
``--set ci`` is a representative subset (CI runs it for both architectures); ``--set full`` is
every option set, LSTM/GRU hidden 128/256/1024, projection, float32/bfloat16/float64, the local
layers at bench_gpu_local.py's shapes and attention at seed 001's.

    python benchmarks/gpu_static.py [--set ci|full] [--arch sm_90a,sm_80] [--json FILE]
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

os.environ.pop("TRITON_INTERPRET", None)  # compile for real (before triton is imported)
os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="fastlayers-gpu-static-")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

import fastlayers  # noqa: E402
from fastlayers._core import backend as _backend, precision as _precision  # noqa: E402
from fastlayers.local import locally_connected2d  # noqa: E402
from fastlayers.rnn import _gpu_graphs  # noqa: E402
from fastlayers.rnn._gpu import gru_engine_gpu, lstm_engine_gpu  # noqa: E402

# per SM: (registers, warps, programs, shared memory bytes, SMs on the card, compute capability);
# sm_86 (A10G, 80 SMs) and sm_75 (T4, 40 SMs, no bf16 MMA) on request (--arch): the cloud's
# common smaller GPUs, checked to compile (BENCHMARKS.md)
ARCH = {"sm_90a": (65536, 64, 32, 227 * 1024, 132, 90), "sm_80": (65536, 64, 32, 163 * 1024, 108, 80),
        "sm_86": (65536, 48, 16, 99 * 1024, 80, 86), "sm_75": (65536, 32, 16, 64 * 1024, 40, 75)}
SPILL_LIMIT = 16  # bytes, float32 / bfloat16 kernels
# kernels allowed more, with the measurement that chose their spilling configuration: the local
# forward's default blocks of 4 warps spill 144-232 bytes at the 3x3 shapes and were the fastest
# measured on the H200 (2026-11-26, bench_gpu_local.py --sweep): 63 us against 94 us for the same
# block on 8 warps, which does not spill (32x4x256^2 3x3 -> 2), 242 against 368 us (64x16x64^2 3x3 -> 32)
SPILL_ALLOWED = {"local._forward_kernel": 256}


class CompileOnlyDriver:
    """What JITFunction.run asks of the active driver before it launches: a device, a stream, a target."""

    def __init__(self, target: GPUTarget) -> None:
        self.target = target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> GPUTarget:
        return self.target

    def is_active(self) -> bool:
        return True


@dataclass
class Kernel:
    """One compiled specialization and what ptxas says of it."""

    kernel: str
    config: str
    dtypes: str
    warps: int
    programs: int
    workload: str
    hash: str = ""
    registers: int = -1
    spill_stores: int = -1
    spill_loads: int = -1
    stack: int = -1
    shared: int = 0
    occupancy: float = 0.0
    reductions: int = 0  # tt.reduce ops in the Triton IR (one per tl.sum / tl.max)
    barriers: int = 0  # BAR instructions in the SASS
    lengths_waits: int | None = None  # global loads that wait for len_b (recurrent step kernels; None: no len_b load)
    atomics: int = 0  # atomic instructions (atom., red.) in the PTX: none allowed (deterministic training)
    compiles: int = 1  # specializations of this configuration (kernel, constexprs, dtypes) compiled


@dataclass
class Record:
    arch: str
    kernels: dict[tuple, Kernel] = field(default_factory=dict)
    hashes: dict[tuple, set] = field(default_factory=dict)
    workload: str = ""
    compiled: dict[str, object] = field(default_factory=dict)


def _short(value) -> str:
    return "T" if value is True else "F" if value is False else str(value)


def _dtype_name(args) -> str:
    names = sorted({str(a.dtype).replace("torch.", "") for a in args if isinstance(a, torch.Tensor)
                    and a.dtype.is_floating_point})
    return "/".join(names)


def install(record: Record) -> Callable[[], None]:
    """Compile instead of launch, and record every launch's configuration; returns the undo."""
    original = JITFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        compiled = original(self, *args, grid=grid, warmup=True, **kwargs)
        flags = {k: v for k, v in kwargs.items() if k not in ("num_warps", "num_stages", "num_ctas", "debug",
                                                               "instrumentation_mode")}
        config = ",".join(f"{k}={_short(v)}" for k, v in sorted(flags.items()) if v is not False)
        key = (self.fn.__module__.rsplit(".", 1)[-1] + "." + self.fn.__name__, config, _dtype_name(args))
        programs = math.prod(grid) if isinstance(grid, tuple) else -1
        record.hashes.setdefault(key, set()).add(compiled.hash)
        if key not in record.kernels:
            record.kernels[key] = Kernel(*key, warps=compiled.metadata.num_warps, programs=programs,
                                         workload=record.workload, hash=compiled.hash)
            record.compiled[compiled.hash] = compiled
        return compiled

    JITFunction.run = run
    return lambda: setattr(JITFunction, "run", original)


def _tools(arch: str) -> tuple[str, list[str], str]:
    """(ptxas, its extra options, cuobjdump) as the installed Triton compiles for ``arch``: Triton 3.9
    assembles sm_90 with its newer ptxas ("ptxas-blackwell") and --regAllocOptLevel=2, 3.6 with ptxas."""
    from triton.backends.nvidia import compiler as nvidia

    ptxas = nvidia.get_ptxas(ARCH[arch][5]).path
    extra = ["--regAllocOptLevel=2"] if "regAllocOptLevel" in inspect.getsource(nvidia) else []
    return ptxas, extra, triton.knobs.nvidia.cuobjdump.path


@functools.lru_cache(maxsize=None)
def _lengths_load_line() -> str:
    """``_cell.py:LINE``: where the recurrent step kernels load len_b (fastlayers._triton._cell.locate)."""
    from fastlayers._triton import _cell

    lines, first = inspect.getsourcelines(_cell.locate.fn)
    return f"_cell.py:{first + next(i for i, line in enumerate(lines) if 'tl.load(lengths' in line)}:"


def atomics(ptx: str) -> int:
    """Atomic read-modify-writes and reductions to memory in a PTX listing (``atom.``, ``red.``):
    sums whose order depends on scheduling, which deterministic training (issue 67) rules out."""
    return len(re.findall(r"^\s*(?:@%p\d+\s+)?(?:atom|red)\.", ptx, flags=re.M))


def lengths_waits(ptx: str) -> int | None:
    """How many global loads of a kernel's PTX wait for its load of len_b, found by a def-use walk
    from that load's result (through every instruction and predicate); None without such a load.
    In the recurrent step kernels the lengths only decide which rows run: every address is known
    without them, so the step's loads all go out at once (see fastlayers._triton._cell)."""
    where, here, tainted, waits, found = _lengths_load_line(), "", set(), 0, False
    zeroed: dict[str, str] = {}  # register -> the source line of the `mov %r, 0x0` that opens its load
    for raw in ptx.splitlines():
        line = raw.strip()
        if line.startswith(".loc"):
            here = line.rsplit("//", 1)[1].strip() if "//" in line else ""
            continue
        if not line or line.startswith(("//", ".", "$", "{", "}")):
            continue
        guard = re.match(r"@!?(%p\d+)\s+", line)
        body = line[guard.end():] if guard else line
        op, _, args = body.rstrip(";").partition(" ")
        if op.startswith("st."):  # a store defines no register (its first one is an address)
            continue
        if op.startswith("mov") and args.endswith("0x0"):
            zeroed[args.split(",")[0]] = here
        if op.startswith("ld.global"):
            dsts = re.findall(r"%[a-z]+\d+", args.split("[", 1)[0])
            srcs = re.findall(r"%[a-z]+\d+", args.split("[", 1)[1]) + ([guard.group(1)] if guard else [])
            # Triton 3.6 puts the load itself at its source line; 3.9 only the mov before it
            if here.startswith(where) or any(zeroed.get(r, "").startswith(where) for r in dsts):
                found = True
                tainted.update(dsts)
            elif tainted.intersection(srcs):
                waits += 1
                tainted.update(dsts)
            continue
        regs = re.findall(r"%[a-z]+\d+", args)
        if regs and tainted.intersection(regs[1:] + ([guard.group(1)] if guard else [])):
            tainted.add(regs[0])
    return waits if found else None


def ptxas_facts(kernel: Kernel, compiled, arch: str) -> None:
    ptxas, extra, cuobjdump = _tools(arch)
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(compiled.asm["ptx"])
    try:
        out = subprocess.run([ptxas, "-v", *extra, f"--gpu-name={arch}", f.name, "-o", os.devnull],
                             capture_output=True, text=True, check=True).stderr
    finally:
        os.unlink(f.name)
    kernel.registers = int(re.search(r"Used (\d+) registers", out).group(1))
    m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", out)
    kernel.stack, kernel.spill_stores, kernel.spill_loads = (int(g) for g in m.groups())
    kernel.shared = int(compiled.metadata.shared)
    kernel.reductions = compiled.asm["ttir"].count("tt.reduce.return")
    kernel.lengths_waits = lengths_waits(compiled.asm["ptx"])
    kernel.atomics = atomics(compiled.asm["ptx"])
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
        f.write(compiled.asm["cubin"])
    try:
        sass = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True).stdout
        kernel.barriers = len(re.findall(r"\bBAR\.", sass))
    finally:
        os.unlink(f.name)
    regs_sm, warps_sm, programs_sm, shared_sm, _, _ = ARCH[arch]
    regs_per_warp = math.ceil(max(kernel.registers, 1) * 32 / 256) * 256
    by_regs = regs_sm // regs_per_warp // kernel.warps
    by_shared = shared_sm // kernel.shared if kernel.shared else programs_sm
    resident = min(programs_sm, warps_sm // kernel.warps, by_regs, by_shared)
    kernel.occupancy = resident * kernel.warps / warps_sm


# ---- workloads: what the layers launch

T, B = 16, 32  # seed batch; T=16 keeps the specializations of T=800 (divisible by 16)
T_CHUNKED = 13  # the chunked run's T: neither T nor a multiple of the chunk


def _rnn(cell: str, hidden: int, dtype: torch.dtype, train: bool = False, **options):
    """fwd+bwd of the module with lengths, its loops eagerly at T, then as captured chunks at
    T_CHUNKED without lengths (rnn/_gpu_graphs.py, emulated: the chunk's launches compile as a replay
    would launch them): a configuration compiled twice would show as compiles > 1. Without cell
    options the GPU engine is called directly (on CUDA plain modules dispatch to it). With them, the
    varlen form too (``cu_seqlens``: the kernels' VARLEN configurations), eagerly and chunked."""
    def call(m, steps, lengths):
        x = torch.randn(steps, B, 512, dtype=dtype, requires_grad=True)
        if m.options.plain:
            engine = lstm_engine_gpu if cell == "LSTM" else gru_engine_gpu
            states = tuple(x.new_zeros(2 * m.num_layers, B, size) for size in m._state_sizes())
            out = engine(x, states, m._layer_parameters(), lengths, m.options, training=m.training)[0]
        else:
            out = m(x, lengths=lengths)[0]
        out.backward(torch.ones_like(out))

    def varlen(m, lens):
        cu = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lens, 0)])
        x = torch.randn(int(cu[-1]), 512, dtype=dtype, requires_grad=True)
        out = m(x, cu_seqlens=cu)[0]
        out.backward(torch.ones_like(out))

    def run():
        torch.manual_seed(0)
        m = getattr(fastlayers, cell)(512, hidden, bidirectional=True, **options).to(dtype).train(train)
        lens = torch.randint(T // 2, T + 1, (B,))
        lens[0] = T
        call(m, T, lens)
        if not m.options.plain:
            varlen(m, lens)
        with _gpu_graphs.emulated():
            call(m, T_CHUNKED, None)
            if not m.options.plain:
                varlen(m, lens[:B // 2])
    return run


def _local(batch: int, chans: int, hw: int, k: int, out: int, dtype: torch.dtype):
    def run():
        x = torch.empty(batch, chans, hw, hw, dtype=dtype)
        w = torch.empty(out, chans, k, k, hw, hw, dtype=dtype, requires_grad=True)
        b = torch.empty(out, hw, hw, dtype=dtype, requires_grad=True)
        x.requires_grad_(k > 1)  # the seed's 1x1 input needs no gradient; the 3x3 case computes dX too
        y = locally_connected2d(x, w, b, 1, k // 2)
        y.backward(torch.empty_like(y))
    return run


def _attention(dtype: torch.dtype, values_grad: bool, score: str = "dot"):
    def run():
        g = torch.Generator().manual_seed(0)
        q = torch.randn(128, 32, generator=g).to(dtype).requires_grad_(True)
        k = torch.randn(128, 256, 32, generator=g).to(dtype).requires_grad_(True)
        v = torch.randn(128, 256, 100, generator=g).to(dtype).requires_grad_(values_grad)
        lengths = torch.randint(128, 257, (128,), generator=g)
        context, weights = fastlayers.attention_pool(q, k, v, lengths, score=score)
        (context.sum() + weights.sum()).backward()
    return run


F32, BF16, F64 = torch.float32, torch.bfloat16, torch.float64
LSTM_OPTIONS = {"ln": dict(layer_norm=True), "peephole+clip": dict(peephole=True, cell_clip=3.0),
                "zoneout+rdrop(train)": dict(zoneout=(0.1, 0.1), recurrent_dropout=0.25, train=True),
                "proj+clip+ln": dict(proj_size=128, proj_clip=2.0, layer_norm=True),
                "all(train)": dict(layer_norm=True, peephole=True, cell_clip=3.0, zoneout=(0.1, 0.1),
                                   recurrent_dropout=0.25, proj_size=128, proj_clip=2.0, train=True)}
GRU_OPTIONS = {"ln": dict(layer_norm=True), "zoneout+rdrop(train)": dict(zoneout=0.1, recurrent_dropout=0.25,
                                                                         train=True)}


def workloads(which: str) -> dict[str, Callable[[], None]]:
    out: dict[str, Callable[[], None]] = {}
    if which == "ci":
        out["LSTM ln H=256 float32"] = _rnn("LSTM", 256, F32, layer_norm=True)
        out["LSTM all(train) H=256 float32"] = _rnn("LSTM", 256, F32, **LSTM_OPTIONS["all(train)"])
        out["GRU ln H=256 bfloat16"] = _rnn("GRU", 256, BF16, layer_norm=True)
        out["attention float32, values grad"] = _attention(F32, True)
        out["attention bfloat16, values grad"] = _attention(BF16, True)
        out["local 3x3 float32"] = _local(32, 4, 256, 3, 2, F32)
        return out
    for cell, options in (("LSTM", LSTM_OPTIONS), ("GRU", GRU_OPTIONS)):
        out[f"{cell} plain H=256 float32"] = _rnn(cell, 256, F32)
        for name, opts in options.items():
            out[f"{cell} {name} H=256 float32"] = _rnn(cell, 256, F32, **opts)
        for hidden in (128, 1024):
            out[f"{cell} ln H={hidden} float32"] = _rnn(cell, hidden, F32, layer_norm=True)
        for dtype in (BF16, F64):
            out[f"{cell} ln H=256 {str(dtype)[6:]}"] = _rnn(cell, 256, dtype, layer_norm=True)
    for shape in [(32, 4, 256, 1, 2), (1024, 4, 256, 1, 2), (32, 4, 256, 3, 2), (64, 16, 64, 3, 32)]:
        out[f"local {shape[0]}x{shape[1]}x{shape[2]}^2 {shape[3]}x{shape[3]} -> {shape[4]} float32"] = _local(*shape, F32)
    out["local 32x4x256^2 1x1 -> 2 bfloat16"] = _local(32, 4, 256, 1, 2, BF16)
    for dtype in (F32, BF16, F64):
        for values_grad in (False, True):
            out[f"attention {str(dtype)[6:]}{', values grad' if values_grad else ''}"] = _attention(dtype, values_grad)
        out[f"attention scaled_dot {str(dtype)[6:]}, values grad"] = _attention(dtype, True, "scaled_dot")
    return out


def clear_caches() -> None:
    """Forget every compiled kernel (in memory and on disk): the next workload's first call compiles."""
    for module in ("lstm", "gru", "step_matmul", "local", "attention"):
        mod = sys.modules.get(f"fastlayers._triton.{module}")
        for obj in vars(mod).values() if mod else ():
            if isinstance(obj, JITFunction):
                obj.device_caches.clear()
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="fastlayers-gpu-static-")
    try:
        triton.knobs.cache.dir = os.environ["TRITON_CACHE_DIR"]
    except AttributeError:  # older Triton reads the variable
        pass


def run_arch(arch: str, which: str, only: str = "") -> tuple[Record, dict[str, float], list[str]]:
    record = Record(arch)
    target = GPUTarget("cuda", ARCH[arch][5], 32)
    driver.set_active(CompileOnlyDriver(target))
    _backend.unavailable = lambda name, op, x: None  # CPU tensors on the triton backend, compile-only
    # a GPU multiplies bfloat16 / float16 in hardware: the products of low-precision workloads take
    # low operands, as on the GPU (not float32 copies, as on a CPU without those instructions)
    _precision._NATIVE.update({("cpu", torch.bfloat16): True, ("cpu", torch.float16): True})
    undo = install(record)
    times, errors = {}, []
    try:
        for name, work in workloads(which).items():
            if only not in name:
                continue
            clear_caches()
            record.workload = name
            start = time.perf_counter()
            try:
                with fastlayers.backend("triton"):
                    work()
            except Exception as e:  # a compile error: reported, and the run fails
                errors.append(f"{arch} {name}: {type(e).__name__}: {str(e).splitlines()[0][:300]}")
            times[name] = time.perf_counter() - start
            print(f"  .. {arch} {name}: {times[name]:.1f} s", file=sys.stderr, flush=True)
    finally:
        undo()
    for key, kernel in record.kernels.items():
        kernel.compiles = len(record.hashes[key])
        ptxas_facts(kernel, record.compiled[kernel.hash], arch)
    return record, times, errors


def table(record: Record) -> str:
    rows = [f"| kernel ({record.arch}) | constexprs | dtypes | warps | registers | spills st/ld B | stack B | "
            f"shared B | reductions | barriers | loads after len_b | atomics | programs | occupancy | compiles | first seen in |",
            "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for k in sorted(record.kernels.values(), key=lambda k: (k.kernel, k.dtypes, k.config)):
        rows.append(f"| {k.kernel} | {k.config} | {k.dtypes} | {k.warps} | {k.registers} | {k.spill_stores}/"
                    f"{k.spill_loads} | {k.stack} | {k.shared} | {k.reductions} | {k.barriers} | "
                    f"{'-' if k.lengths_waits is None else k.lengths_waits} | {k.atomics} | {k.programs} | "
                    f"{k.occupancy:.2f} | {k.compiles} | "
                    f"{k.workload} |")
    return "\n".join(rows)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--set", dest="which", default="ci", choices=["ci", "full"])
    p.add_argument("--arch", default="sm_90a,sm_80")
    p.add_argument("--json", default=None)
    p.add_argument("--only", default="", help="only the workloads whose name contains this, e.g. 'local'")
    args = p.parse_args()
    print(f"triton {triton.__version__}, torch {torch.__version__}; compile-only, no GPU needed")
    failures, summary = [], {}
    for arch in args.arch.split(","):
        record, times, errors = run_arch(arch, args.which, args.only)
        failures += errors
        print(table(record))
        print(f"\nfirst call (compile) per workload, {arch}, this CPU: " +
              "; ".join(f"{n} {t:.1f} s" for n, t in times.items()) + "\n")
        for k in record.kernels.values():
            low = "float64" not in k.dtypes
            limit = SPILL_ALLOWED.get(k.kernel, SPILL_LIMIT)
            if low and max(k.spill_stores, k.spill_loads) > limit:
                failures.append(f"{arch} {k.kernel} [{k.dtypes}; {k.config}]: spills {k.spill_stores}/"
                                f"{k.spill_loads} bytes (limit {limit} for float32/bfloat16)")
            recurrent = k.kernel.startswith(("lstm.", "gru."))
            if recurrent and k.lengths_waits is None:  # the walk needs its start (the lengths are always data)
                failures.append(f"{arch} {k.kernel} [{k.dtypes}; {k.config}]: no load of len_b found at "
                                f"{_lengths_load_line()} in its PTX")
            if k.kernel.startswith(("lstm.", "gru.", "step_matmul.")) and k.compiles != 1:
                failures.append(f"{arch} {k.kernel} [{k.dtypes}; {k.config}]: compiled {k.compiles} times (expected "
                                f"1: the step, the loop's length and the buffers' capacity are not specialised)")
            if k.atomics:
                failures.append(f"{arch} {k.kernel} [{k.dtypes}; {k.config}]: {k.atomics} atomic instructions in its "
                                f"PTX (expected none: every sum runs in a fixed order, results repeat bit for bit)")
            # (the varlen layout's rows are its sequences' own: a row that does not run reads its last)
            if recurrent and k.lengths_waits and "VARLEN" not in k.config:
                failures.append(f"{arch} {k.kernel} [{k.dtypes}; {k.config}]: {k.lengths_waits} global loads wait "
                                f"for len_b (expected 0: the lengths decide which rows run, never an address)")
        summary[arch] = {"kernels": [asdict(k) for k in record.kernels.values()], "first_call_s": times}
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    for f in failures:
        print("FAIL:", f)
    print(f"{'FAILED' if failures else 'passed'}: {sum(len(s['kernels']) for s in summary.values())} kernels, "
          f"{len(failures)} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
