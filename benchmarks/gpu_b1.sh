#!/usr/bin/env bash
# 4-GPU batch 1: record hash on CUDA (bits, throughput, probe overhead), the tree fixes' Triton
# kernels (bits, speed), and `--fix all` bitwise at TP=1,2,4 with those kernels.
set -u
source benchmarks/gpu_setup.sh
{
echo "## record hash on CUDA: Triton kernel vs torch path (bits)"
python3 benchmarks/check_record_hash.py
echo
python3 benchmarks/bench_probes.py hash
echo
overhead_1b 3
} > "$OUT/probes.md" 2>&1
timeout 200 python3 benchmarks/gpu_tree_kernels.py --out "$OUT" > "$OUT/tree_stdout.txt" 2>&1
echo "tree rc=$?" >> "$OUT/tree_stdout.txt"
mkdir -p /tmp/m
{
echo "| run | status | per degree | worlds |"
echo "|---|---|---|---|"
for spec in "tiny-fp32-fix:--dtype float32" "tiny-bf16-fix:--dtype bfloat16" "med-fp32-fix:--model medium-llama --dtype float32 --seq-len 256 --batch-size 4" "med-bf16-fix:--model medium-llama --dtype bfloat16 --seq-len 256 --batch-size 4"; do
  n=${spec%%:*}; a=${spec#*:}
  timeout 150 python3 -m tpdiag.cli compare --device cuda --tp 1,2,4 --fix all --no-confirm --out /tmp/m/$n --format json $a >/tmp/m/$n.json 2>/tmp/m/$n.err
  show $n /tmp/m
done
} > "$OUT/fixall.md" 2>&1
rm -f "$OUT"/probes_overhead_llama-1b_bfloat16.json
cat "$OUT/probes.md" | tail -40; tail -30 "$OUT/tree_kernels.md" 2>/dev/null; cat "$OUT/fixall.md"
