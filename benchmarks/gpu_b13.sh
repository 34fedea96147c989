#!/usr/bin/env bash
# 4-GPU batch 13 (4x H200), fifth session: batch 12's TP=4 first divergence (the input of
# layers.0.attention.wo, inside unprobed attention code) drilled down to the op:
# `--granularity auto` reruns the divergent degree recording ops inside that module.
set -u
source benchmarks/gpu_setup.sh
mkdir -p /tmp/m
{
echo "| run | status | per degree | worlds |"
echo "|---|---|---|---|"
run_cmp l1b-op 1,4 420 --model llama-1b --dtype bfloat16 --seq-len 2048 --batch-size 1 --granularity auto --no-confirm --no-baseline
} > "$OUT/compare.md" 2>&1
cp /tmp/m/l1b-op/summary.json "$OUT/l1b_op_summary.json" 2>/dev/null
tail -c 1500 /tmp/m/l1b-op.err > "$OUT/l1b_op_err.txt" 2>/dev/null
python3 - <<'PY' >> "$OUT/compare.md" 2>&1
import json
s = json.load(open("/tmp/m/l1b-op/summary.json"))
d = s["degrees"]["4"]
print(json.dumps({k: d.get(k) for k in ("first_divergence", "op_level", "findings")}, indent=1)[:3000])
PY
cat "$OUT/compare.md"
