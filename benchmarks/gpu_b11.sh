#!/usr/bin/env bash
# 2-GPU batch 11 (2x H200), fifth session, after batch 10: the queued hash launches take their
# tables from a ring of pinned host / device rows (no pinned allocation per launch) and launch
# directly; checked bit for bit (the ring wraps), timed side by side with a launch per record
# (three overhead runs at batch 1 x seq 2048, one at batch 2 x seq 4096), hash-mode compare at
# TP=1,2 on NCCL.
set -u
source benchmarks/gpu_setup.sh
timeout 120 python3 benchmarks/check_record_hash.py > "$OUT/check_hash.txt" 2>&1; echo "check hash rc=$?"; tail -4 "$OUT/check_hash.txt"
timeout 120 python3 benchmarks/bench_probes.py launch > "$OUT/launch.md" 2>&1; echo "launch rc=$?"; tail -12 "$OUT/launch.md"
{
for i in 1 2 3; do
  CUDA_VISIBLE_DEVICES=0 timeout 150 python3 benchmarks/bench_probes.py overhead --model llama-1b --dtype bfloat16 \
    --seq 2048 --batch 1 --rounds 7 --modes none,hash,hash-each
  echo "run $i rc=$?"; echo
done
CUDA_VISIBLE_DEVICES=0 timeout 120 python3 benchmarks/bench_probes.py overhead --model llama-1b --dtype bfloat16 \
  --seq 4096 --batch 2 --rounds 7 --modes none,hash,hash-each
echo "bs2 rc=$?"
} > "$OUT/overhead.md" 2>&1
grep -E "^\||rc=|overhead:" "$OUT/overhead.md" | grep -v "|---" | tail -30
{
echo "| run | status | per degree | worlds |"
echo "|---|---|---|---|"
for spec in "med-bf16-hash:--model medium-llama --dtype bfloat16 --seq-len 256 --batch-size 4 --capture hash" \
            "med-bf16-fix-hash:--model medium-llama --dtype bfloat16 --seq-len 256 --batch-size 4 --fix all --capture hash --no-confirm"; do
  run_cmp "${spec%%:*}" 1,2 $((590 - SECONDS)) ${spec#*:}
done
} > "$OUT/compare.md" 2>&1
cat "$OUT/compare.md"
