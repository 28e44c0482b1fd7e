"""Build of fastlayers' native code: the C++ operators (``_native/ops.cpp``, TORCH_LIBRARY) and the C
kernels (``_native/lstm.c``, ``gru.c``, ``local.c``) linked into one shared library per CPU variant,
compiled when the package is built (``pip install --no-build-isolation .``, ``pip wheel
--no-build-isolation .``, editable installs alike) with torch's ``BuildExtension``; at run time
fastlayers loads one variant, chosen from the CPU's features (:mod:`fastlayers._native`), and
compiles nothing.

Variants on x86-64 (PyTorch's own capability levels and flags, ``ATEN_CPU_CAPABILITY``):
``default`` (the x86-64 baseline), ``avx2`` (AVX2 + FMA + F16C) and ``avx512`` (AVX-512 F/BW/VL/DQ
+ FMA); elsewhere ``default`` only. The C kernels are compiled once per variant; ``ops.cpp`` (ATen
calls around them, no variant-specific code) once, its object linked into every variant;
``variant.cpp`` records each library's variant (``fastlayers_variant()``).

The library links against the torch it is built with (its C++ ABI), so the package requires that
torch version exactly (``install_requires``); build with ``--no-build-isolation`` against the
torch you run.
"""

from __future__ import annotations

import os
import platform
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from setuptools import setup
from setuptools._distutils.ccompiler import new_compiler
from setuptools._distutils.sysconfig import customize_compiler
from torch.utils.cpp_extension import BuildExtension, CppExtension

NATIVE = Path("src") / "fastlayers" / "_native"
C_SOURCES = ("lstm.c", "gru.c", "local.c", "matmul.c", "masks.c")
# -fno-trapping-math -fno-signed-zeros: lets GCC if-convert the clamps and selects of the pointwise
# loops into vector compare + blend. No -ffinite-math-only: it lets GCC assume no NaN/inf (x * 0 -> 0,
# min/max that drop NaN), and the step kernels then turned a NaN input into finite outputs.
C_FLAGS = ["-O3", "-g0", "-fno-wrapv", "-ffp-contract=fast", "-fno-trapping-math", "-fno-signed-zeros", "-fopenmp", "-fPIC",
           "-std=gnu99"]
CXX_FLAGS = ["-O2", "-g0", "-std=c++20", "-fopenmp"]
_SPLIT = ["-mno-avx256-split-unaligned-load", "-mno-avx256-split-unaligned-store"]  # (as PyTorch's builds)
_AVX2 = ["-mavx2", "-mfma", "-mf16c", *_SPLIT]
X86_VARIANTS = {"default": [], "avx2": _AVX2, "avx512": [*_AVX2, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"]}
VARIANTS = X86_VARIANTS if platform.machine().lower() in ("x86_64", "amd64") else {"default": []}
FIRST = next(iter(VARIANTS))  # the variant whose build compiles ops.cpp


class BuildNative(BuildExtension):
    """torch's BuildExtension, plus the C kernels: compiled for each variant with C flags (they are
    C99, not C++) and linked into that variant's library, with the ops.cpp object of the first.
    The C compiles (one per variant and source) run in threads beside the C++ build, on every core
    but one (about 60 s serially here, of which the C files take 33)."""

    def build_extensions(self) -> None:
        workers = max(1, (os.cpu_count() or 1) - 1)
        with ThreadPoolExecutor(workers) as pool:
            self._c_objects = {(variant, source): pool.submit(self._compile_c, variant, source)
                               for variant in VARIANTS for source in C_SOURCES}
            super().build_extensions()

    def _compile_c(self, variant: str, source: str) -> list[str]:
        c_compiler = new_compiler(verbose=self.verbose, force=True)  # (plain C: not
        customize_compiler(c_compiler)  # the extension compiler, which torch's BuildExtension makes a C++ one)
        output = str(Path(self.build_temp) / "fastlayers-c" / variant)
        return c_compiler.compile([str(NATIVE / source)], output_dir=output, include_dirs=[str(NATIVE)],
                                  extra_postargs=[*C_FLAGS, *VARIANTS[variant]])

    def build_extension(self, ext) -> None:
        variant = ext.name.rsplit("_C_", 1)[-1]
        objects = [o for source in C_SOURCES for o in self._c_objects[variant, source].result()]
        if variant != FIRST:  # ops.cpp's object, compiled by the first variant's build
            objects += self.compiler.object_filenames([str(NATIVE / "ops.cpp")], output_dir=self.build_temp)
        ext.extra_objects = list(objects)
        super().build_extension(ext)


def _extensions() -> list[CppExtension]:
    return [CppExtension(f"fastlayers._native._C_{variant}",
                         [*([str(NATIVE / "ops.cpp")] if variant == FIRST else []), str(NATIVE / "variant.cpp")],
                         extra_compile_args={"cxx": [*CXX_FLAGS, f'-DFL_VARIANT="{variant}"']},
                         py_limited_api=True,  # no libtorch_python: the library loads in a C++ program without Python
                         # torch's libraries from the installed torch, also for a C++ program that links this file
                         extra_link_args=["-fopenmp", "-Wl,-rpath,$ORIGIN/../../torch/lib"],
                         depends=[str(p) for p in sorted(NATIVE.glob("*.[ch]"))])
            for variant in VARIANTS]


setup(ext_modules=_extensions(),
      cmdclass={"build_ext": BuildNative.with_options(no_python_abi_suffix=True)},
      install_requires=[f"torch=={torch.__version__.split('+')[0]}", "numpy>=1.24"])
