#!/usr/bin/env bash
# 2-GPU batch 6 (2x H200): `--fix all` bitwise at TP=1,2 with the bf16x6 fp32 GEMM and the
# tensor-core row-parallel groups; the fp32 column-parallel divergence confirmed; llama-1b
# compare --tp 1,2 under strict deterministic algorithms (its confirmation); fix cost at TP=2.
set -u
source benchmarks/gpu_setup.sh
mkdir -p /tmp/m
{
echo "| run | status | per degree | worlds |"
echo "|---|---|---|---|"
for spec in "tiny-fp32-fix:--dtype float32 --fix all --no-confirm" "tiny-bf16-fix:--dtype bfloat16 --fix all --no-confirm" \
            "med-fp32-fix:--model medium-llama --dtype float32 --seq-len 256 --batch-size 4 --fix all --no-confirm" \
            "med-bf16-fix:--model medium-llama --dtype bfloat16 --seq-len 256 --batch-size 4 --fix all --no-confirm" \
            "tiny-fp32-stock:--dtype float32" "tiny-bf16-stock:--dtype bfloat16"; do
  n=${spec%%:*}; a=${spec#*:}
  s0=$SECONDS
  timeout 150 python3 -m tpdiag.cli compare --device cuda --tp 1,2 --out /tmp/m/$n --format json $a >/tmp/m/$n.json 2>/tmp/m/$n.err
  echo "$n rc=$? wall $((SECONDS - s0)) s"; show $n /tmp/m
done
s0=$SECONDS
timeout 240 python3 -m tpdiag.cli compare --device cuda --model llama-1b --dtype bfloat16 --tp 1,2 --seq-len 2048 --batch-size 1 --out /tmp/m/l1b --format json >/tmp/m/l1b.json 2>/tmp/m/l1b.err
echo "llama-1b compare rc=$? wall $((SECONDS - s0)) s (default flow: auto capture, baseline, region pass, confirm; strict determinism)"
show l1b /tmp/m
} > "$OUT/compare.md" 2>&1
cp /tmp/m/l1b/summary.json "$OUT/l1b_summary.json" 2>/dev/null
tail -c 1500 /tmp/m/l1b.err > "$OUT/l1b_err_tail.txt" 2>/dev/null
cat "$OUT/compare.md"
timeout $((585 - SECONDS)) python3 benchmarks/bench_fix_cost.py --tp 2 --iters 5 > "$OUT/fix_cost.md" 2>&1
echo "fix cost rc=$?"; tail -8 "$OUT/fix_cost.md"
