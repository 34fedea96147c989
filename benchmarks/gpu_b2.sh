#!/usr/bin/env bash
# 4-GPU batch 2: record hash throughput/overhead (persistent kernel) and the fix cost.
# (Its first version also ran the ~1B compare, the OOM and the diff benchmark; they crashed on
# the AsyncCollectiveTensor bug and moved to gpu_b3.sh after the fix.)
set -u
source benchmarks/gpu_setup.sh
{
python3 benchmarks/bench_probes.py hash
echo
overhead_1b 3
} > "$OUT/probes.md" 2>&1
rm -f "$OUT"/probes_overhead_*.json
timeout $((570 - SECONDS)) python3 benchmarks/bench_fix_cost.py --tp 2,4 --iters 5 > "$OUT/fix_cost.md" 2>&1
grep -v -e Warning -e run_backward "$OUT/probes.md"; tail -5 "$OUT/fix_cost.md" 2>/dev/null
