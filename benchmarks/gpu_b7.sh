#!/usr/bin/env bash
# 2-GPU batch 7 (2x H200), fourth session: the record hash's cached direct launch checked bit for
# bit and timed (host time per record, probe overhead A/B); the fix step at TP=2 with the
# row-parallel backward on tensor cores (cost + a profile); `--fix all` still bitwise at TP=1,2.
set -u
source benchmarks/gpu_setup.sh
timeout 120 python3 benchmarks/check_record_hash.py > "$OUT/check_hash.txt" 2>&1; echo "check hash rc=$?"; tail -3 "$OUT/check_hash.txt"
timeout 120 python3 benchmarks/bench_probes.py launch > "$OUT/launch.md" 2>&1; echo "launch rc=$?"; cat "$OUT/launch.md" | tail -12
timeout 240 python3 benchmarks/bench_fix_cost.py --tp 2 --iters 7 --profile 30 > "$OUT/fix_cost.md" 2>&1
echo "fix cost rc=$?"; tail -5 "$OUT/fix_cost.md"
CUDA_VISIBLE_DEVICES=0 timeout 200 python3 benchmarks/bench_probes.py overhead --model llama-1b --dtype bfloat16 \
  --seq 2048 --batch 1 --rounds 5 --modes none,hash,hash-jit,full > "$OUT/overhead.md" 2>&1
echo "overhead rc=$?"; tail -7 "$OUT/overhead.md"
{
echo "| run | status | per degree | worlds |"
echo "|---|---|---|---|"
for spec in "tiny-bf16-fix:--dtype bfloat16 --fix all --no-confirm" \
            "med-bf16-fix:--model medium-llama --dtype bfloat16 --seq-len 256 --batch-size 4 --fix all --no-confirm" \
            "tiny-fp32-fix:--dtype float32 --fix all --no-confirm" "tiny-bf16-stock:--dtype bfloat16"; do
  run_cmp "${spec%%:*}" 1,2 $((590 - SECONDS)) ${spec#*:}
done
} > "$OUT/compare.md" 2>&1
cat "$OUT/compare.md"
