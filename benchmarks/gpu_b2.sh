#!/usr/bin/env bash
# 4-GPU batch 2: record hash throughput/overhead (persistent kernel), `compare --tp 1,2,4` wall
# time on a ~1B model, a real CUDA OOM at one degree, diff throughput, fix cost.
set -u
source benchmarks/gpu_setup.sh
{
python3 benchmarks/bench_probes.py hash
echo
python3 benchmarks/bench_probes.py overhead --model llama-1b --dtype bfloat16 --seq 2048 --batch 1 --rounds 3
echo
python3 benchmarks/bench_probes.py overhead --model llama-1b --dtype bfloat16 --seq 4096 --batch 2 --rounds 3
} > "$OUT/probes.md" 2>&1
rm -f "$OUT"/probes_overhead_*.json
mkdir -p /tmp/m
{
echo "| run | status | per degree | worlds |"
echo "|---|---|---|---|"
s0=$SECONDS
timeout 260 python3 -m tpdiag.cli compare --device cuda --model llama-1b --dtype bfloat16 --tp 1,2,4 --seq-len 2048 --batch-size 1 --out /tmp/m/l1b --format json >/tmp/m/l1b.json 2>/tmp/m/l1b.err
echo "llama-1b compare rc=$? wall $((SECONDS - s0)) s (default flow: auto capture, baseline, region pass, confirm)"
show l1b /tmp/m
s0=$SECONDS
TPDIAG_CUDA_MEM_FRACTION=0.07 timeout 120 python3 -m tpdiag.cli compare --device cuda --model llama-1b --dtype float32 --tp 4,2,1 --seq-len 1024 --batch-size 1 --no-confirm --no-baseline --out /tmp/m/oom --format json >/tmp/m/oom.json 2>/tmp/m/oom.err
echo "OOM run rc=$? wall $((SECONDS - s0)) s; processes left: $(pgrep -fc 'tpdiag' || true)"
show oom /tmp/m
s0=$SECONDS
timeout 100 python3 -m tpdiag.cli compare --device cuda --model medium-llama --dtype float32 --tp 1,2,4 --seq-len 2048 --batch-size 2 --capture full --no-confirm --no-baseline --out /tmp/m/medfull --format json >/tmp/m/medfull.json 2>/tmp/m/medfull.err
echo "medium full rc=$? wall $((SECONDS - s0)) s"
show medfull /tmp/m
} > "$OUT/compare.md" 2>&1
python3 benchmarks/bench_probes.py diff /tmp/m/medfull > "$OUT/diff.md" 2>&1
cp /tmp/m/l1b/summary.json "$OUT/l1b_summary.json" 2>/dev/null
if [ $SECONDS -lt 450 ]; then
  timeout $((570 - SECONDS)) python3 benchmarks/bench_fix_cost.py --tp 2,4 --iters 5 > "$OUT/fix_cost.md" 2>&1
fi
cat "$OUT/probes.md" | grep -v Warning | grep -v run_backward; cat "$OUT/compare.md" "$OUT/diff.md"; cat "$OUT/fix_cost.md" 2>/dev/null | tail -5
