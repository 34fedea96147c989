#!/usr/bin/env bash
# 2-GPU batch 11 (2x H200), fifth session, after batch 10: the queued hash launches take their
# tables from a ring of pinned host / device rows (no pinned allocation per launch) and launch
# directly; checked bit for bit (the ring wraps), timed side by side with a launch per record
# (three overhead runs at batch 1 x seq 2048, one at batch 2 x seq 4096), hash-mode compare at
# TP=1,2 on NCCL.
set -u
source benchmarks/gpu_setup.sh
hash_checks
overhead_ab none,hash,hash-each "" 7
{
echo "| run | status | per degree | worlds |"
echo "|---|---|---|---|"
for spec in "med-bf16-hash:--model medium-llama --dtype bfloat16 --seq-len 256 --batch-size 4 --capture hash" \
            "med-bf16-fix-hash:--model medium-llama --dtype bfloat16 --seq-len 256 --batch-size 4 --fix all --capture hash --no-confirm"; do
  run_cmp "${spec%%:*}" 1,2 $((590 - SECONDS)) ${spec#*:}
done
} > "$OUT/compare.md" 2>&1
cat "$OUT/compare.md"
