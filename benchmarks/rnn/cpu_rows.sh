#!/usr/bin/env bash
# Issue 62's rows for one CPU: every command of BENCHMARKS.md's per-CPU table and its CPU section,
# one after another (never two at once on 2 cores), each into OUT/<name>.txt, with the CPU and
# commit first. About 25 minutes on 2 cores (AMD Zen 4).
# Usage: bash benchmarks/rnn/cpu_rows.sh [OUT]   (from the repository root; `make cpu-rows OUT=...`)
set -euo pipefail
out=${1:-cpu-rows}
mkdir -p "$out"
py=${PYTHON:-.venv/bin/python}
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
# torch.nn.LSTM with its memory kept mapped (glibc told to keep what it frees): compute against compute
mapped="MALLOC_MMAP_THRESHOLD_=4294967296 MALLOC_TRIM_THRESHOLD_=68719476736"
run() {  # run NAME COMMAND...: the command line first, then its output
  local name=$1
  shift
  echo "== $name" >&2
  { echo "\$ $*"; env "$@"; } > "$out/$name.txt" 2>&1
}
{
  echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown), $(date -u +%Y-%m-%dT%H:%MZ)"
  grep -m4 -E "vendor_id|model name|cpu family|^model\s" /proc/cpuinfo || true
  grep -o -w -E "avx2|avx512f|avx512_bf16|amx_bf16" /proc/cpuinfo | sort -u | tr '\n' ' '
  echo
  getconf -a | grep -E "LEVEL[23]_CACHE_SIZE" || true
  $py -c "from fastlayers import _native; print(_native.describe())"
} > "$out/cpu.txt" 2>&1
run floor $py benchmarks/rnn/bench_cpu_floor.py --repeats 5 --compare-products
# an AVX2-only CPU stood in for on this one (meaningful where it has AVX-512): our avx2 build against
# torch held to AVX2 too (its kernels, oneDNN, MKL); not a measurement of such a CPU
run floor_avx2 FASTLAYERS_CPU_CAPABILITY=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 \
  MKL_ENABLE_INSTRUCTIONS=AVX2 $py benchmarks/rnn/bench_cpu_floor.py --repeats 5
run large_products $py benchmarks/rnn/bench_large_products.py
run products_threshold $py benchmarks/rnn/bench_products_threshold.py
run page_faults $py benchmarks/rnn/probe_page_faults.py
# shellcheck disable=SC2086
run page_faults_mapped $mapped $py benchmarks/rnn/probe_page_faults.py
run native_variant $py benchmarks/rnn/bench_native_variant.py 5
run gru_engine PYTHONPATH=src:benchmarks/rnn $py benchmarks/rnn/bench_gru_engine.py --repeats 5
run random_t $py benchmarks/rnn/bench_cpu_random_t.py
run sweep_unidirectional $py benchmarks/rnn/bench_cpu_sweep.py --repeats 5 --unidirectional
run sweep $py benchmarks/rnn/bench_cpu_sweep.py --repeats 5
run overhead $py benchmarks/bench_overhead.py --min-run-time 2 --rounds 20
echo "done: $out" >&2
