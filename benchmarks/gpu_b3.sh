#!/usr/bin/env bash
# 4-GPU batch 3: hash capture at TP>1 on CUDA after the AsyncCollectiveTensor fix, `compare --tp
# 1,2,4` wall time on a ~1B model, a real CUDA OOM at one degree, diff throughput.
set -u
source benchmarks/gpu_setup.sh
mkdir -p /tmp/m
{
echo "| run | status | per degree | worlds |"
echo "|---|---|---|---|"
s0=$SECONDS
timeout 90 python3 -m tpdiag.cli compare --device cuda --model small-llama --tp 1,2,4 --capture hash --no-confirm --out /tmp/m/smallhash --format json >/tmp/m/smallhash.json 2>/tmp/m/smallhash.err
echo "small-llama hash rc=$? wall $((SECONDS - s0)) s"; show smallhash /tmp/m
s0=$SECONDS
timeout 90 python3 -m tpdiag.cli compare --device cuda --model small-llama --tp 1,2,4 --capture full --no-confirm --seq-len 512 --batch-size 4 --out /tmp/m/smallfull --format json >/tmp/m/smallfull.json 2>/tmp/m/smallfull.err
echo "small-llama full rc=$? wall $((SECONDS - s0)) s"; show smallfull /tmp/m
s0=$SECONDS
timeout 240 python3 -m tpdiag.cli compare --device cuda --model llama-1b --dtype bfloat16 --tp 1,2,4 --seq-len 2048 --batch-size 1 --out /tmp/m/l1b --format json >/tmp/m/l1b.json 2>/tmp/m/l1b.err
echo "llama-1b compare rc=$? wall $((SECONDS - s0)) s (default flow: auto capture, baseline, region pass, confirm)"
show l1b /tmp/m
s0=$SECONDS
TPDIAG_CUDA_MEM_FRACTION=0.07 timeout 100 python3 -m tpdiag.cli compare --device cuda --model llama-1b --dtype float32 --tp 4,2,1 --seq-len 1024 --batch-size 1 --no-confirm --no-baseline --out /tmp/m/oom --format json >/tmp/m/oom.json 2>/tmp/m/oom.err
echo "OOM run rc=$? wall $((SECONDS - s0)) s; tpdiag processes left: $(pgrep -f 'tpdiag' | wc -l)"
show oom /tmp/m
} > "$OUT/compare.md" 2>&1
python3 benchmarks/bench_probes.py diff /tmp/m/smallfull > "$OUT/diff.md" 2>&1
cp /tmp/m/l1b/summary.json "$OUT/l1b_summary.json" 2>/dev/null
cp /tmp/m/l1b/manifest.json "$OUT/l1b_manifest.json" 2>/dev/null
cp /tmp/m/oom/summary.json "$OUT/oom_summary.json" 2>/dev/null
cat "$OUT/compare.md" "$OUT/diff.md"
