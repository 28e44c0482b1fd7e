#!/usr/bin/env bash
# What make test checks of the GPU code without a GPU, after the interpreter tests: the static
# compile sets (gpu_static.py --set ci: sm_90a and sm_80 with the venv's Triton, then sm_90a with
# the newest Triton) and every step of gpu_check.sh's dry run. Two lanes of one process each, for the CI
# machine's two cores: lane 1 the static sets then the dry-run steps named in LANE1_STEPS, lane 2
# every other dry-run step. Each lane's output is printed whole once both are done; the exit status
# is non-zero when either lane failed.
#
#     PYTHON=.venv/bin/python NEWEST=.venv/triton-3.9.0 benchmarks/gpu_check_cpu.sh
set -uo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
newest=${NEWEST:?NEWEST=DIR: the newest Triton, installed with pip --target DIR}
# with the static sets (about 195 s since they compile the varlen kernels too) about 265 s, as lane 2 (2026-11-27)
lane1_steps=${LANE1_STEPS:-remat}
logs=$(mktemp -d)

{
    "$py" benchmarks/gpu_static.py --set ci &&
        PYTHONPATH="$newest" "$py" benchmarks/gpu_static.py --set ci --arch sm_90a &&
        STEPS="$lane1_steps" PYTHON="$py" benchmarks/gpu_check.sh "$logs/lane1" --dry-run
} >"$logs/lane1.txt" 2>&1 &
lane1=$!
SKIP_STEPS="$lane1_steps" PYTHON="$py" benchmarks/gpu_check.sh "$logs/lane2" --dry-run >"$logs/lane2.txt" 2>&1
rc2=$?
wait "$lane1"
rc1=$?
echo "== lane 1 (rc $rc1): gpu_static.py --set ci, then --arch sm_90a ($newest); dry-run steps: $lane1_steps"
cat "$logs/lane1.txt"
echo "== lane 2 (rc $rc2): the other dry-run steps"
cat "$logs/lane2.txt"
[ "$rc1" = 0 ] && [ "$rc2" = 0 ]
