#!/usr/bin/env bash
# Every benchmark behind BENCHMARKS.md, one after another (never two at once on 2 cores).
# Usage: bash benchmarks/run_all.sh OUTDIR   (takes about two hours: torch's packed LSTM backward and the per-step loops are the slow part)
set -euo pipefail
out=${1:-bench-results}
mkdir -p "$out"
py=${PYTHON:-.venv/bin/python}
fl=${FASTLAYERS:-.venv/bin/fastlayers}
$py benchmarks/rnn/bench_rnn_lengths.py --repeats 3 --json "$out/rnn_lengths.json" > "$out/rnn_lengths.txt"
$py benchmarks/rnn/bench_rnn_lengths.py --configs LSTM:padded,GRU:padded --repeats 11 > "$out/rnn_padded.txt"
$py benchmarks/rnn/bench_engine.py --repeats 5 > "$out/engine.txt"
$py benchmarks/rnn/bench_gru_engine.py --repeats 5 > "$out/gru_engine.txt"
$py benchmarks/rnn/bench_lengths_paths.py > "$out/lengths_paths.txt" 2>/dev/null
$py benchmarks/rnn/bench_step_fusion.py --repeats 20 --steps 100 > "$out/step_fusion.txt"
$py benchmarks/bench_mixed_precision.py --repeats 3 > "$out/mixed_precision.txt" 2>/dev/null
$py benchmarks/attention/bench_attention.py --repeats 20 > "$out/attention_pool.txt"
$py benchmarks/local/bench_local_kernels.py > "$out/local_kernels.txt"
$py benchmarks/local/bench_local.py --repeats 20 > "$out/local.txt"
for w in attention local2d fused-rnn; do
  $fl bench "$w" --size seed --repeats 5 --overwrite --json "$out/$w.json" --plot "$out/$w.png" > "$out/$w.txt"
done
$fl bench blstm --size seed --repeats 3 --overwrite --json "$out/blstm.json" --plot "$out/blstm.png" > "$out/blstm.txt"
# GPU tables (issue: Triton kernels), only where a CUDA GPU is present
if $py -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  $py benchmarks/bench_gpu_local.py --device cuda --repeats 20 > "$out/gpu_local.txt"
  $py benchmarks/rnn/bench_gpu_engine.py --device cuda --repeats 7 > "$out/gpu_engine.txt"
  for w in attention local2d; do
    $fl bench "$w" --size seed --device cuda --repeats 20 --overwrite --json "$out/$w-cuda.json" > "$out/$w-cuda.txt"
  done
  $fl bench local2d --size seed-large --device cuda --repeats 20 --overwrite --json "$out/local2d-large-cuda.json" \
    > "$out/local2d-large-cuda.txt"
fi
