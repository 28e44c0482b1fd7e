#!/usr/bin/env bash
# One command for a GPU session (issue: every GPU path run on the H100): the cuda-marked tests, then
# every GPU benchmark, each with its own time limit (the steps before issue 41's end inside 9
# minutes, its steps need another command: STEPS below), every log and one JSON summary written
# into OUTDIR (on the device machine: $OUT). Runs from source:
#
#     benchmarks/gpu_check.sh OUTDIR            # on the GPU machine (torch 2.11, Triton 3.6)
#     benchmarks/gpu_check.sh OUTDIR --dry-run  # anywhere: Triton's interpreter, tiny shapes, CPU
#     STEPS="random_t train" benchmarks/gpu_check.sh OUTDIR   # only the steps named (each <= 10 min)
#     SKIP_STEPS="remat" benchmarks/gpu_check.sh OUTDIR        # every step but those named
#     DEADLINE=$(( $(date +%s) + 540 )) benchmarks/gpu_check.sh OUTDIR  # no step runs past that time
#                                    # (epoch seconds): a device lease is short; steps run in order
#
# The dry run (make test runs it) checks that every step still starts and finishes; its times
# mean nothing. Steps and limits (seconds, 540 in all before issue 41's 600; on the H100 with torch 2.11 on 2026-11-24,
# before the sweep step, the steps took 8, 42, 101, 53, 65, 28, 22 and >30 s):
# versions and nvidia-smi (20); tests/test_cuda.py (150: on a fresh machine Triton compiles every kernel
# first; over 60 s on the H200 on 2026-11-27, 26 s warm); bench_gpu_engine.py fp32 TF32 off, every
# option set (120), TF32 on (60) and autocast bf16 (70) for the layer_norm sets, the device time
# per kernel of the LSTM layer_norm rows, eager, with and without lengths (30); plain LSTM / GRU
# against cuDNN at several shapes (--sweep, 60); bench_gpu_local.py, every shape with its copy
# floor, then attention pooling (60); gpu_static.py's CI set compiled for this machine's Triton
# (60; 30 ran out on 2026-11-24). Issue 41: the random-T workload, T ~ U[100, 1000] per call,
# plain and layer_norm LSTM / GRU against cuDNN on the PackedSequence, captures counted, peak memory
# against fixed T = 1000 (150); the same for LSTM with chunks of 16 and of 64 steps instead of 32
# (150); issue 40: checkpoint_every through the GPU engine, bench_remat.py at T = 800, B = 32, its
# --sweep of k there, and the T = 1k..100k scaling at B = 8, the allocator's peak (240); issue 42:
# bench_overhead.py, eager calls on CUDA (120), its layer_norm rows with every loop captured
# (EAGER_STEPS=0, 60); fastlayers train on the digits and the vowels
# against torch.nn.LSTM + PackedSequence (300; needs the dataset wheels: FASTLAYERS_DATA); issue 67:
# bench_gpu_engine.py --small-hidden (110), bench_gpu_deterministic.py (90; 45 s on the H200),
# probe_gpu_persistent.py (150, with the row-wise forward and fwd+bwd of 2026-11-27; 15 s there before them), probe_gpu_remat.py (90; about 40 s on the H200), bench_remat.py --every 100 and 200 in fresh processes
# (150, not yet run), probe_gpu_buffers.py (60, not yet run); issue 66: bench_varlen.py --checkpoint (60),
# probe_gpu_buffers.py --varlen (60, not yet run). On the H200 on 2026-11-26 (torch 2.11, Triton 3.6) the
# steps took: versions 5, cuda_tests 50, local_attention 12, remat 136 (before the sweep), random_t
# 29, train 51, engine_fp32 52, chunk_sweep 29 s; on 2026-11-27 local_attention 16, random_t 34, varlen 15 s.
# On the GPU machine the first step builds the native library in place (setup.py: about a minute
# with a C++ compiler there; a copy built elsewhere is for another torch). All steps take longer than one 10-minute command: name a few in STEPS per command. A step that
# fails or runs out of time is recorded in summary.json (rc 124 for a timeout) and the next one runs.
set -uo pipefail
out=${1:?usage: benchmarks/gpu_check.sh OUTDIR [--dry-run]}
mode=${2:-}
cd "$(dirname "$0")/.."
mkdir -p "$out"
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export FASTLAYERS_OFFLINE="${FASTLAYERS_OFFLINE:-1}"  # the GPU machine has no network: no dataset download
py=${PYTHON:-python3}
if [ "$mode" = "--dry-run" ]; then
    export TRITON_INTERPRET=1
    # one option set per engine step: the interpreter runs every step kernel in Python
    device=cpu size=small local_size=small repeats=1 local_repeats=1 warmup=0 only_all="LSTM zoneout" \
        only_ln="GRU zoneout" \
        only_profile="GRU zoneout"
    random_t=(--device cpu --size small --calls 1 --warmup 1 --fixed-calls 1 --only GRU)
    train=(--device cpu --epochs 1 --max-samples 32 --datasets vowels)
    remat=(--device cpu --steps 12 --batch 2) remat_scaling=(--device cpu --scaling 8 --batch 2 --with-torch --calls 1)
    remat_sweep=(--device cpu --steps 12 --batch 2 --calls 1 --sweep none,auto,5)
    overhead=(--device cpu --min-run-time 0.01 --rounds 1)
    det_runs=2 only_det="GRU zoneout 0.1 + recurrent" small_cells=GRU
    varlen=(--device cpu --batch 3 --t-max 8 --repeats 1 --checkpoint)
else
    device=cuda size=seed local_size=seed repeats=5 local_repeats=20 warmup=2 only_all="" only_ln="layer_norm" \
        only_profile="LSTM layer_norm"
    random_t=(--device cuda)
    train=(--device cuda)
    remat=(--device cuda --steps 800 --batch 32)
    remat_scaling=(--device cuda --scaling 1000,4000,16000,100000 --batch 8 --with-torch --calls 1 --max-gib 70)
    remat_sweep=(--device cuda --steps 800 --batch 32 --sweep none,auto,32,64,128,200,400,800)
    overhead=(--device cuda)
    det_runs=3 only_det="" small_cells=LSTM,GRU
    varlen=(--device cuda --repeats 5 --checkpoint)
fi
rounds=(--repeats "$repeats" --warmup "$warmup")  # timed rounds, untimed rounds before them
steps=()

step() {  # step NAME LIMIT_S COMMAND...: run it with a time limit, log to OUTDIR/NAME.log
    local name=$1 limit=$2
    shift 2
    if [ -n "${STEPS:-}" ] && [[ " $STEPS " != *" $name "* ]]; then
        return 0
    fi
    if [ -n "${SKIP_STEPS:-}" ] && [[ " $SKIP_STEPS " == *" $name "* ]]; then
        return 0
    fi
    local start end rc
    if [ -n "${DEADLINE:-}" ]; then  # cap the step's limit at what is left; skip it under 10 s
        local left=$(( DEADLINE - $(date +%s) ))
        if [ "$left" -lt 10 ]; then
            echo "$name: skipped, DEADLINE reached" | tee "$out/$name.log"
            steps+=("$name 124 0 0")
            return 0
        fi
        if [ "$left" -lt "$limit" ]; then limit=$left; fi
    fi
    start=$(date +%s.%N)
    timeout "$limit" "$@" >"$out/$name.log" 2>&1
    rc=$?
    end=$(date +%s.%N)
    steps+=("$name $rc $start $end")
    awk -v n="$name" -v r="$rc" -v s="$start" -v e="$end" 'BEGIN { printf "%-16s rc=%-3s %6.1f s\n", n, r, e - s }'
}

if [ "$mode" != "--dry-run" ]; then  # the native library, built in place against the machine's torch (every run)
    timeout 300 "$py" setup.py --quiet build_ext --inplace >"$out/build.log" 2>&1 ||
        echo "building the native library failed (see $out/build.log): the CPU paths run pure PyTorch"
fi
step versions 20 "$py" -c "import torch, triton, platform; print('torch', torch.__version__, 'cuda', \
torch.version.cuda, 'triton', triton.__version__, 'python', platform.python_version()); \
print('gpu', torch.cuda.get_device_name() if torch.cuda.is_available() else 'none')"
if command -v nvidia-smi >/dev/null; then nvidia-smi >"$out/nvidia-smi.txt" 2>&1; fi
step cuda_tests 150 "$py" -m pytest -p no:cacheprovider -m cuda tests/test_cuda.py
step engine_fp32 120 "$py" benchmarks/rnn/bench_gpu_engine.py --device "$device" --size "$size" "${rounds[@]}" \
    --only "$only_all"
step engine_tf32 60 "$py" benchmarks/rnn/bench_gpu_engine.py --device "$device" --size "$size" "${rounds[@]}" \
    --tf32 --only "$only_ln"
step engine_bf16 70 "$py" benchmarks/rnn/bench_gpu_engine.py --device "$device" --size "$size" "${rounds[@]}" \
    --autocast bf16 --only "$only_ln"
step engine_profile 30 "$py" benchmarks/rnn/bench_gpu_engine.py --device "$device" --size "$size" --only "$only_profile" \
    --profile
step engine_sweep 60 "$py" benchmarks/rnn/bench_gpu_engine.py --device "$device" "${rounds[@]}" --sweep
step local_attention 60 "$py" benchmarks/bench_gpu_local.py --device "$device" --size "$local_size" \
    --repeats "$local_repeats" --warmup "$warmup"
if [ "$mode" != "--dry-run" ]; then  # (make test runs the static check itself)
    step static 60 "$py" benchmarks/gpu_static.py --set ci --arch sm_90a --json "$out/static.json"
fi
step random_t 150 "$py" benchmarks/rnn/bench_gpu_random_t.py "${random_t[@]}" --json "$out/random_t.json"
if [ "$mode" != "--dry-run" ]; then  # the chunk's length: 16 and 64 steps against the default's 32
    step chunk_sweep 150 bash -c "'$py' benchmarks/rnn/bench_gpu_random_t.py --device cuda --only LSTM --chunk 16 && \
'$py' benchmarks/rnn/bench_gpu_random_t.py --device cuda --only LSTM --chunk 64"
fi
# checkpoint_every through the GPU engine (issue 40): time and the allocator's peak, with and without
step remat 240 bash -c "'$py' benchmarks/rnn/bench_remat.py ${remat[*]} --json '$out/remat.json' && \
'$py' benchmarks/rnn/bench_remat.py ${remat_sweep[*]} && \
'$py' benchmarks/rnn/bench_remat.py ${remat_scaling[*]} --json '$out/remat_scaling.json'"
# per-call cost of every layer and cell at small shapes against torch.nn, eager calls on CUDA (issue 42)
step overhead 120 "$py" benchmarks/bench_overhead.py "${overhead[@]}"
# the option rows again with every loop captured (EAGER_STEPS=0): what the small calls' eager loops gain
step overhead_captured 60 "$py" benchmarks/bench_overhead.py "${overhead[@]}" --only layer_norm --eager-steps 0
step train 300 "$py" benchmarks/bench_gpu_train.py "${train[@]}" --json "$out/train.json"
# issue 67: small hidden sizes against cuDNN's persistent kernels, deterministic training (bitwise
# repeats and the mode's cost), the persistent-step probe (grid barrier, us per step)
step small_hidden 110 "$py" benchmarks/rnn/bench_gpu_engine.py --device "$device" --small-hidden --cells "$small_cells" \
    "${rounds[@]}"
step deterministic 90 "$py" benchmarks/rnn/bench_gpu_deterministic.py --device "$device" --size "$size" \
    --runs "$det_runs" --repeats "$repeats" --only "$only_det"
step persistent_probe 150 "$py" benchmarks/rnn/probe_gpu_persistent.py --device "$device"
if [ "$mode" != "--dry-run" ]; then  # checkpoint_every's per-segment cost: time per k, launches, copies, syncs
    step remat_probe 90 "$py" benchmarks/rnn/probe_gpu_remat.py --device cuda
    # fresh-process memory at k = T / 8 and T / 4 (the probe's peaks leave the captured buffers out):
    # which k meets 1/8 of the run without, for the Triton engine's "auto"
    step remat_k 150 bash -c "'$py' benchmarks/rnn/bench_remat.py --device cuda --steps 800 --batch 32 --every 100 && \
'$py' benchmarks/rnn/bench_remat.py --device cuda --steps 800 --batch 32 --every 200"
fi
if [ "$mode" != "--dry-run" ]; then  # what a captured layer's loop entry holds, by buffer (seed shape)
    step buffers 60 "$py" benchmarks/rnn/probe_gpu_buffers.py --device cuda
    # issue 66: the entry of the padded call with lengths against the varlen call's (value rows)
    step varlen_buffers 60 "$py" benchmarks/rnn/probe_gpu_buffers.py --device cuda --varlen --steps 1600
fi
# issue 66: the varlen form against the padded call with lengths, time and the allocator's peak
step varlen 60 "$py" benchmarks/rnn/bench_varlen.py "${varlen[@]}"

"$py" - "$out" "${steps[@]}" <<'EOF'
import json, sys
out, *rows = sys.argv[1:]
summary = []
for row in rows:
    name, rc, start, end = row.split()
    with open(f"{out}/{name}.log", errors="replace") as f:
        tail = f.read()[-2000:]
    summary.append({"step": name, "rc": int(rc), "timed_out": rc == "124", "seconds": round(float(end) - float(start), 1),
                    "log": f"{name}.log", "tail": tail})
with open(f"{out}/summary.json", "w") as f:
    json.dump(summary, f, indent=1)
failed = [s["step"] for s in summary if s["rc"] != 0]
print(f"summary: {out}/summary.json; {len(summary)} steps, failed: {', '.join(failed) or 'none'}")
sys.exit(1 if failed else 0)
EOF
