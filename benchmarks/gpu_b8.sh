#!/usr/bin/env bash
# 4-GPU batch 8 (4x H200), fourth session: fix cost at TP=2 and TP=4, every fix alone too, after
# the launch-count cuts (one invariant-gemm call per column layer, tensor-core row-parallel
# backward, one gather for the grad norm, all-gather into one buffer); probe overhead A/B of the
# cached direct hash launch; `--fix all` bitwise at TP=1,2,4 (tiny + medium, bf16 + fp32) and the
# stock fp32 / bf16 confirmations with the new code.
set -u
source benchmarks/gpu_setup.sh
timeout 260 python3 benchmarks/bench_fix_cost.py --tp 2,4 --iters 7 --each --profile 25 > "$OUT/fix_cost.md" 2>&1
echo "fix cost rc=$?"; grep "^|" "$OUT/fix_cost.md"
CUDA_VISIBLE_DEVICES=0 timeout 150 python3 benchmarks/bench_probes.py overhead --model llama-1b --dtype bfloat16 \
  --seq 2048 --batch 1 --rounds 7 --modes none,hash,hash-jit,full > "$OUT/overhead.md" 2>&1
echo "overhead rc=$?"; tail -7 "$OUT/overhead.md"
{
echo "| run | status | per degree | worlds |"
echo "|---|---|---|---|"
for spec in "tiny-bf16-fix:--dtype bfloat16 --fix all --no-confirm" "tiny-fp32-fix:--dtype float32 --fix all --no-confirm" \
            "tiny-fp32-stock:--dtype float32" "tiny-bf16-stock:--dtype bfloat16" \
            "med-bf16-fix:--model medium-llama --dtype bfloat16 --seq-len 256 --batch-size 4 --fix all --no-confirm" \
            "med-fp32-fix:--model medium-llama --dtype float32 --seq-len 256 --batch-size 4 --fix all --no-confirm"; do
  run_cmp "${spec%%:*}" 1,2,4 $((590 - SECONDS)) ${spec#*:}
done
} > "$OUT/compare.md" 2>&1
cat "$OUT/compare.md"
