#!/usr/bin/env bash
# 2-GPU batch 10 (2x H200), fifth session: hash mode's queued records (many per launch) checked
# bit for bit against the torch path and timed side by side with a launch per record (probe
# overhead A/B, three runs at batch 1 x seq 2048, one at batch 2 x seq 4096); hash-mode compare
# at TP=1,2 on NCCL still finds and confirms what it found before, and `--fix all` stays bitwise.
set -u
source benchmarks/gpu_setup.sh
hash_checks
overhead_ab none,hash,hash-each ",full" 5
CUDA_VISIBLE_DEVICES=0 timeout 60 python3 benchmarks/bench_probes.py profile --model llama-1b --seq 2048 > "$OUT/profile.txt" 2>&1
echo "profile rc=$?"; head -30 "$OUT/profile.txt"
{
echo "| run | status | per degree | worlds |"
echo "|---|---|---|---|"
for spec in "med-bf16-hash:--model medium-llama --dtype bfloat16 --seq-len 256 --batch-size 4 --capture hash" \
            "tiny-bf16-fix-hash:--dtype bfloat16 --fix all --capture hash --no-confirm" \
            "med-fp32-fix-hash:--model medium-llama --dtype float32 --seq-len 256 --batch-size 4 --fix all --capture hash --no-confirm"; do
  run_cmp "${spec%%:*}" 1,2 $((590 - SECONDS)) ${spec#*:}
done
} > "$OUT/compare.md" 2>&1
cat "$OUT/compare.md"
