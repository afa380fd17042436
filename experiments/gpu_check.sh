#!/usr/bin/env bash
# The benchmark of experiments/bench.py on one real GPU (N = 1), plus the
# bandwidth an Adam update reaches against the HBM roofline. About 3-5 minutes
# on one H200; writes bench.json, tables.md and plots to $OUT (the device
# tool's output folder) or experiments/results/gpu.
#
#   bash experiments/gpu_check.sh                 # on a machine with a GPU
#   HBM_TB_S=3.35 bash experiments/gpu_check.sh   # H100 SXM roofline
#   GPU_CHECK_DRY=1 bash experiments/gpu_check.sh # tiny CPU dry run of this script
#
# Needs jax with a CUDA backend (pip install -e '.[cuda,experiments]').
# At N = 1 there is no communication: ZeRO-1/DDP measures what ZeRO-1's
# packing, fp32 master and grad-norm cost on one device, and the memory
# section shows the fp32-master overhead (12 Psi on one device, as DDP).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python; fi
OUT_DIR="${OUT:-experiments/results/gpu}"
mkdir -p "$OUT_DIR"
HBM_TB_S="${HBM_TB_S:-4.8}"   # H200 SXM: 4.8 TB/s

if [ "${GPU_CHECK_DRY:-0}" = "1" ]; then
  exec timeout 300 "$PY" -m experiments.bench --platform cpu --ns 1 \
    --sections state,memory,speed,adam_bw --state-size xxs --speed-sizes xxs,xs \
    --ratio-sizes xxs,xs --seq-len 16 --global-batch 4 --per-device-batch 4 \
    --speed-budget 2 --adam-bw-psi 1048576 --hbm-tb-s "$HBM_TB_S" --out "$OUT_DIR"
fi

"$PY" - <<'EOF'
import jax, sys
b = jax.default_backend()
print("backend:", b, jax.devices())
if b != "gpu":
  sys.exit("gpu_check: jax has no GPU backend here (install jax[cuda12]); nothing measured")
EOF
nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv || true

# bert-small (~29M params with the 260-byte vocabulary) and bert-base (~86M),
# 32 x 128 tokens per step; Adam bandwidth on 256M fp32 parameters.
timeout 290 "$PY" -m experiments.bench --platform gpu --ns 1 \
  --sections state,memory,speed,adam_bw --state-size bert-small \
  --speed-sizes bert-small,bert-base --ratio-sizes bert-small,bert-base \
  --seq-len 128 --global-batch 32 --per-device-batch 32 --speed-budget 20 \
  --adam-bw-psi 268435456 --hbm-tb-s "$HBM_TB_S" --out "$OUT_DIR" \
  2>&1 | grep -v -i "warning" | tee "$OUT_DIR/gpu_check.log"
