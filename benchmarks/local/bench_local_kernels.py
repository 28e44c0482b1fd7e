"""The locally connected C kernels alone (no autograd, outputs preallocated), seed-003 shape, fp32.

Prints min/median ms over 40 calls for 1 and 2 threads, next to a 64 MiB tensor copy. With
``--against REV`` it also builds ``_native/local.c`` as it was at git revision REV (same compiler
flags) and times both builds interleaved in this process, forward then parameter and input gradients, for the
1x1 seed shape and a 3x3 kernel (padding 1), or the ``--shapes`` given, so that a kernel change is
measured side by side.

    python benchmarks/local/bench_local_kernels.py [--against REV [--shapes "B,C,O,H,K;..."]]
"""

from __future__ import annotations

import argparse
import ast
import ctypes
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from fastlayers import _native
from fastlayers.local._cpu import _lib, typed


def timed(fn, n: int = 40) -> str:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return f"{min(times) * 1e3:.2f}/{statistics.median(times) * 1e3:.2f}"


def native_flags(repo: Path, variant: str) -> list[str]:
    """The C flags setup.py compiles the kernels of ``variant`` with (its ``C_FLAGS`` and the
    variant's, read from setup.py's assignments without running it)."""
    wanted = {"C_FLAGS", "_SPLIT", "_AVX2", "X86_VARIANTS"}
    names: dict = {}
    for node in ast.parse((repo / "setup.py").read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id in wanted for t in node.targets):
            exec(compile(ast.Module([node], []), "setup.py", "exec"), names)  # list literals of strings
    return [*names["C_FLAGS"], *names["X86_VARIANTS"].get(variant, [])]


def build_at(rev: str, workdir: Path) -> ctypes.CDLL:
    """local.c (and the headers next to it) as of git revision ``rev``, compiled as setup.py compiles
    the variant loaded here (a local.c from before the kernels took their offsets table as a last
    argument ignores it)."""
    repo = Path(__file__).resolve().parents[2]
    native = "src/fastlayers/_native"
    files = subprocess.run(["git", "-C", str(repo), "ls-tree", "--name-only", rev, f"{native}/"], check=True,
                           capture_output=True, text=True).stdout.split()
    for path in files:
        if path.endswith((".c", ".h")):
            text = subprocess.run(["git", "-C", str(repo), "show", f"{rev}:{path}"], check=True, capture_output=True,
                                  text=True).stdout
            (workdir / Path(path).name).write_text(text)
    compiler = shutil.which("gcc") or shutil.which("cc")
    out = workdir / "local_old.so"
    flags = native_flags(repo, _native.built_as() or "default")
    subprocess.run([compiler, *flags, "-shared", f"-I{workdir}", str(workdir / "local.c"), "-o", str(out), "-lm"],
                   check=True)
    return typed(ctypes.CDLL(str(out)))


def side_by_side(libs: dict[str, ctypes.CDLL], shape: tuple[int, ...], repeats: int = 15) -> None:
    """Forward, parameter gradient and input gradient with each build in turn (order alternating),
    median ms; ``shape``: B, C, O, H (= W = OH = OW: stride 1, padding K // 2), K."""
    batch, chans, out, size, kernel = shape
    torch.manual_seed(0)
    pad = kernel // 2
    x = F.pad(torch.rand(batch, chans, size, size), (pad,) * 4).contiguous()
    w, b = torch.rand(out, chans, kernel, kernel, size, size), torch.rand(out, size, size)
    dy = torch.rand(batch, out, size, size)
    y, dw, db = torch.empty(batch, out, size, size), torch.empty_like(w), torch.empty_like(b)
    dx = torch.empty_like(x)
    geometry = (batch, chans, x.size(2), x.size(3), out, kernel, kernel, size, size, 1, 1, 1, 1)
    table = torch.empty(chans * kernel * kernel, dtype=torch.int64)  # the kernels' work space (C*KH*KW offsets)
    times = {name: ([], [], []) for name in libs}
    results = {}
    threads = torch.get_num_threads()
    for rep in range(-1, repeats):
        order = list(libs.items()) if rep % 2 else list(libs.items())[::-1]
        for name, lib in order:
            start = time.perf_counter()
            lib.lc2d_forward_f32(x.data_ptr(), w.data_ptr(), b.data_ptr(), y.data_ptr(), *geometry, threads,
                                 table.data_ptr())
            mid = time.perf_counter()
            lib.lc2d_backward_params_f32(dy.data_ptr(), x.data_ptr(), dw.data_ptr(), db.data_ptr(), *geometry,
                                         threads, table.data_ptr())
            end = time.perf_counter()
            dx.zero_()
            start_dx = time.perf_counter()
            lib.lc2d_backward_input_f32(dy.data_ptr(), w.data_ptr(), dx.data_ptr(), *geometry, threads)
            end_dx = time.perf_counter()
            if rep >= 0:
                for i, t in enumerate((mid - start, end - mid, end_dx - start_dx)):
                    times[name][i].append(t)
            results[name] = (y.clone(), dw.clone(), db.clone(), dx.clone())
    first = next(iter(results.values()))
    for name, columns in times.items():
        diff = max((a - r).abs().max().item() for a, r in zip(results[name], first))
        fwd, bwd, bwd_x = (statistics.median(c) * 1e3 for c in columns)
        print(f"  {shape} {name:>8}: forward {fwd:7.3f} ms, parameter gradient {bwd:7.3f} ms, input gradient "
              f"{bwd_x:7.3f} ms (max |difference| to the first build {diff:.1e})")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--against", metavar="REV", help="also time local.c as of this git revision, side by side")
    p.add_argument("--shapes", default="32,4,2,256,1;32,4,2,256,3",
                   help="the side-by-side shapes, ';'-separated B,C,O,H,K (H = W, stride 1, padding K // 2; "
                        "default: the seed's 1x1 and a 3x3)")
    args = p.parse_args()
    lib = _lib()
    assert lib is not None, "the C kernels did not build (no compiler?)"
    torch.manual_seed(0)
    x, w, b = torch.rand(32, 4, 256, 256), torch.rand(2, 4, 1, 1, 256, 256), torch.rand(2, 256, 256)
    dy = torch.rand(32, 2, 256, 256)
    y, dw, db = torch.empty(32, 2, 256, 256), torch.empty_like(w), torch.empty_like(b)
    geometry = (32, 4, 256, 256, 2, 1, 1, 256, 256, 1, 1, 1, 1)
    table = torch.empty(4, dtype=torch.int64)  # the kernels' work space (C*KH*KW offsets)
    src = torch.rand(64 * 2**20 // 4)
    dst = torch.empty_like(src)
    print("threads  forward ms (min/median)  param-grad ms  copy 64 MiB ms")
    for threads in (1, 2):
        fwd = timed(lambda: lib.lc2d_forward_f32(x.data_ptr(), w.data_ptr(), b.data_ptr(), y.data_ptr(), *geometry,
                                                 threads, table.data_ptr()))
        bwd = timed(lambda: lib.lc2d_backward_params_f32(dy.data_ptr(), x.data_ptr(), dw.data_ptr(), db.data_ptr(),
                                                         *geometry, threads, table.data_ptr()))
        print(f"{threads:7d}  {fwd:>23}  {bwd:>13}  {timed(lambda: dst.copy_(src)):>14}")
    if args.against:
        with tempfile.TemporaryDirectory() as tmp:
            old = build_at(args.against, Path(tmp))
            print(f"side by side, {torch.get_num_threads()} threads, median of 15: this tree vs {args.against}")
            for shape in args.shapes.split(";"):
                side_by_side({"this": lib, args.against[:8]: old}, tuple(int(v) for v in shape.split(",")))


if __name__ == "__main__":
    main()
