#!/usr/bin/env bash
# 4-GPU batch 12 (4x H200), fifth session: `compare --tp 1,2,4` on llama-1b in the default flow
# (auto capture = hash with queued records, reference rerun, region pass, confirmation) under
# strict determinism - its wall time and verdict; then `--fix all` in hash mode at TP=1,2,4.
set -u
source benchmarks/gpu_setup.sh
mkdir -p /tmp/m
{
echo "| run | status | per degree | worlds |"
echo "|---|---|---|---|"
run_cmp l1b 1,2,4 420 --model llama-1b --dtype bfloat16 --seq-len 2048 --batch-size 1
run_cmp med-bf16-fix-hash 1,2,4 $((590 - SECONDS)) --model medium-llama --dtype bfloat16 --seq-len 256 --batch-size 4 --fix all --capture hash --no-confirm
} > "$OUT/compare.md" 2>&1
cp /tmp/m/l1b/summary.json "$OUT/l1b_summary.json" 2>/dev/null
cp /tmp/m/l1b/manifest.json "$OUT/l1b_manifest.json" 2>/dev/null
tail -c 1500 /tmp/m/l1b.err > "$OUT/l1b_err.txt" 2>/dev/null
cat "$OUT/compare.md"
