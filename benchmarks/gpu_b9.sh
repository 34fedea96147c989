#!/usr/bin/env bash
# 4-GPU batch 9 (4x H200), fourth session: after the bucketed grad-norm gather - `--fix all`
# bitwise at TP=1,2,4 (tiny bf16, medium-llama fp32 with a longer limit), fix cost at TP=2 and 4.
set -u
source benchmarks/gpu_setup.sh
{ echo "| run | status | per degree | worlds |"; echo "|---|---|---|---|"
  run_cmp tiny-bf16-fix 1,2,4 90 --dtype bfloat16 --fix all --no-confirm; } > "$OUT/compare.md" 2>&1
timeout 200 python3 benchmarks/bench_fix_cost.py --tp 2,4 --iters 9 > "$OUT/fix_cost.md" 2>&1
echo "fix cost rc=$?" >> "$OUT/compare.md"
run_cmp med-fp32-fix 1,2,4 $((585 - SECONDS)) --model medium-llama --dtype float32 --seq-len 256 --batch-size 4 --fix all --no-confirm >> "$OUT/compare.md" 2>&1
tail -c 1500 /tmp/m/med-fp32-fix.err > "$OUT/med_fp32_err_tail.txt" 2>/dev/null
cat "$OUT/compare.md"; grep "^|" "$OUT/fix_cost.md"
