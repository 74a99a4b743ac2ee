#!/usr/bin/env bash
# Decode tuning on the GPU machine in one call: sweep gdn configurations next to FlashInfer (CUDA-graph replays), then
# Nsight Compute on one batch size. Run from the repo root after the peers were installed (source /root/peers/env.sh).
#   FP32_CFGS=... BF16_CFGS=... bash bench/decode_session.sh   (results under $OUT)
set -u
export PYTHONPATH=$PWD/src:${PYTHONPATH:-} PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
BATCHES=${BATCHES:-32,128,512,2048}
python3 bench/sweep_decode.py --out "$OUT/sd_fp32.json" --dtypes float32 --batches "$BATCHES" --configs "${FP32_CFGS:-8:2:1:1}" \
  2>&1 | grep -v -e INFO -e Warn | cut -c1-1500
python3 bench/sweep_decode.py --out "$OUT/sd_bf16.json" --dtypes bfloat16 --batches "$BATCHES" --configs "${BF16_CFGS:-16:2:4:4}" \
  2>&1 | grep -v -e INFO -e Warn | cut -c1-1500
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
if [ -n "${NCU_B:-}" ] && [ -n "$NCU" ]; then
  for dt in float32 bfloat16; do
    cfgs=$([ $dt = float32 ] && echo "${NCU_FP32:-8:2:1:1}" || echo "${NCU_BF16:-16:2:4:4}")
    timeout 150 "$NCU" --profile-from-start off --clock-control none --section SpeedOfLight --section Occupancy \
      --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis \
      python3 bench/ncu_decode.py --B "$NCU_B" --dtype $dt --configs "$cfgs" > "$OUT/ncu_$dt.txt" 2>&1
    grep -E "profiling|^  [a-zA-Z_]+.*\(|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Theoretical Occ|Block Limit Reg|Stall|Warp Cycles Per Issued" "$OUT/ncu_$dt.txt" | cut -c1-150 | head -80
  done
fi
