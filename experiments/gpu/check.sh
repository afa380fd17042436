#!/usr/bin/env bash
# zero1_jax on one real GPU (N = 1): first the numerical checks
# (experiments/gpu/exact.py: ZeRO-1/2 against unsharded optax in fp32, bf16,
# fp16, with clipping, accumulation and both reduce paths) and the README's
# zero1-train command (fp16, dynamic loss scale) saved and resumed; then the
# benchmark (python -m experiments.bench) and the bandwidth an Adam update reaches
# against the HBM roofline. About 5 minutes on one H200 (measured: bench
# 162 s, the checks and overlap together 103 s); writes
# gpu_check.log, bench.json, tables.md, plots and overlap.txt (7 files) to
# $OUT (the device tool's output folder) or experiments/results/gpu (a dry
# run without $OUT: a new temporary folder).
#
#   bash experiments/gpu/check.sh                 # on a machine with a GPU
#   HBM_TB_S=3.35 bash experiments/gpu/check.sh   # H100 SXM roofline
#   GPU_CHECK_DRY=1 bash experiments/gpu/check.sh # tiny CPU dry run of this script
#   bash experiments/gpu/check.sh steps           # only the steps against XLA's estimate
#
# Needs jax with a CUDA backend (pip install -e '.[cuda,experiments]').
# At N = 1 there is no communication: ZeRO-1/DDP measures what ZeRO-1's
# packing, fp32 master and grad-norm cost on one device, and the memory
# section shows the fp32-master overhead (12 Psi on one device, as DDP).
# A phase that fails is reported in the log and the next one still runs;
# the exit status is 1 if any failed.
set -uo pipefail
FAILED=0
cd "$(dirname "$0")/../.."
if [ -x .venv/bin/python ]; then PY=.venv/bin/python; elif command -v python3 >/dev/null; then PY=python3; else PY=python; fi
if [ -z "${OUT:-}" ] && [ "${GPU_CHECK_DRY:-0}" = "1" ]; then
  # a dry run never writes over the committed results
  OUT_DIR="$(mktemp -d -t gpu_check_dry.XXXXXX)"
  echo "gpu_check (dry run): writing to $OUT_DIR"
else
  OUT_DIR="${OUT:-experiments/results/gpu}"
fi
mkdir -p "$OUT_DIR"
HBM_TB_S="${HBM_TB_S:-4.8}"   # H200 SXM: 4.8 TB/s

# z1.inspect.overlap of the bench's ZeRO-1 step (model size, sequence length,
# global batch) on all visible devices: per collective, the compute it could
# hide behind, read from the compiled HLO (N = 1: no collectives are left).
overlap_step() {
  timeout 240 "$PY" -c "import jax, sys, zero1_jax as z1; from experiments.bench import plan as bs; s, L, B = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]); n = jax.device_count(); built = bs.build('zero1_rs', bs.model(s, 'fp32', L), n, bs.device_batch(bs.batch(B, L), n)); print(f'z1.inspect.overlap: ZeRO-1 step, {s}, seq {L}, batch {B}, N={n} ({jax.default_backend()})'); print(z1.inspect.overlap_summary(z1.inspect.overlap(built.compiled)))" "$@" \
    2>&1 | grep -v -i "warning" | tee "$OUT_DIR/overlap.txt"
}

# ZeRO-1/2 against optax, then zero1-train saved at step STEPS/2 and resumed.
correctness() {
  local steps="$1"
  {
    local failed=0
    timeout 300 "$PY" -m experiments.gpu.exact || { echo "gpu_check: gpu_exact FAILED"; failed=1; }
    local run="$PY -m zero1_jax.cli.train --num_devices 1 --deepspeed experiments/configs/ds_zero_stage1.json --model_name_or_path bert-tiny --per_device_train_batch_size 32 --save_steps $((steps / 2)) --output_dir /tmp/z1_gpu_cli"
    echo "zero1-train on $("$PY" -c 'import jax; print(jax.devices()[0].device_kind)'), fp16, saved at step $((steps / 2)), resumed to $steps:"
    timeout 300 $run --max_steps $((steps / 2)) --overwrite_output_dir \
      && timeout 300 $run --max_steps "$steps" --resume latest \
      || { echo "gpu_check: zero1-train FAILED"; failed=1; }
    tail -n 2 /tmp/z1_gpu_cli/metrics.jsonl 2>/dev/null
    exit $failed
  } 2>&1 | grep -v -i "warning" | tee "$OUT_DIR/gpu_check.log"
}

# The steps of experiments/gpu/aot.py (floor, DDP, GSPMD, each zero1 form;
# BERT-base and GPT-2 small, fp32 and bf16 params) run and timed on this GPU
# at N = 1, one process each, beside XLA's estimates (experiments/gpu/measure.py).
# `bash experiments/gpu/check.sh steps` runs this phase alone (~8 minutes on
# an H200, stopping at GPU_CHECK_STEPS_S seconds with what it finished).
steps() {
  timeout $((${GPU_CHECK_STEPS_S:-420} + 60)) "$PY" -m experiments.gpu.measure \
    --out "$OUT_DIR" --deadline "${GPU_CHECK_STEPS_S:-420}" ${GPU_CHECK_STEPS_PLAN:+--plan "$GPU_CHECK_STEPS_PLAN"} \
    ${GPU_CHECK_STEPS_ARGS:-} \
    2>&1 | grep -v -i "warning" | tee "$OUT_DIR/measure.log"
}

if [ "${1:-}" = "steps" ] && [ "${GPU_CHECK_DRY:-0}" = "1" ]; then
  JAX_PLATFORMS=cpu XLA_FLAGS="--xla_force_host_platform_device_count=1" \
    GPU_CHECK_STEPS_PLAN="small-bert:fp32:floor,small-bert:fp32:train_step:nocb" \
    GPU_CHECK_STEPS_ARGS="--iters 1 --repeats 1 --warmup 1" steps
  exit $?
fi

if [ "${GPU_CHECK_DRY:-0}" = "1" ]; then
  JAX_PLATFORMS=cpu XLA_FLAGS="--xla_force_host_platform_device_count=1" correctness 4 || FAILED=1
  timeout 300 "$PY" -m experiments.bench --platform cpu --ns 1 \
    --sections state,memory,speed,adam_bw --state-size xxs --speed-sizes xxs,xs \
    --ratio-sizes xxs,xs --seq-len 16 --global-batch 4 --per-device-batch 4 \
    --speed-budget 2 --adam-bw-psi 1048576 --hbm-tb-s "$HBM_TB_S" --out "$OUT_DIR" \
    || FAILED=1
  JAX_PLATFORMS=cpu XLA_FLAGS="--xla_force_host_platform_device_count=8" \
    overlap_step xxs 16 8 || FAILED=1
  exit $FAILED
fi

"$PY" - <<'EOF'
import jax, sys
b = jax.default_backend()
print("backend:", b, jax.devices())
if b != "gpu":
  sys.exit("gpu_check: jax has no GPU backend here (install jax[cuda12]); nothing measured")
EOF
[ $? = 0 ] || exit 1
nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv || true
if [ "${1:-}" = "steps" ]; then steps; exit $?; fi

correctness 40 || FAILED=1

# bert-small (13.1M params with the 260-byte vocabulary), 32 x 128 tokens per
# step; Adam bandwidth on 256M fp32 parameters. Compiles dominate: measured on
# an H200, this bench took 162 s; with bert-base in the speed section too
# (GPU_CHECK_SPEED_SIZES=bert-small,bert-base) it outran 290 s.
SIZES="${GPU_CHECK_SPEED_SIZES:-bert-small}"
timeout 420 "$PY" -m experiments.bench --platform gpu --ns 1 \
  --sections state,memory,speed,adam_bw --state-size bert-small \
  --speed-sizes "$SIZES" --ratio-sizes "$SIZES" \
  --seq-len 128 --global-batch 32 --per-device-batch 32 --speed-budget 10 \
  --adam-bw-psi 268435456 --hbm-tb-s "$HBM_TB_S" --out "$OUT_DIR" \
  2>&1 | grep -v -i "warning" | tee -a "$OUT_DIR/gpu_check.log" \
  || { echo "gpu_check: bench FAILED (exit or timeout)"; FAILED=1; }

overlap_step bert-small 128 32 || FAILED=1
exit $FAILED
