#!/usr/bin/env bash
# 1-GPU batch 4 (H200): record hash after the [R, CB]-tile / no-mask kernel (bits, launch-shape
# sweep, host time per record, a profiled hash-mode step, probe overhead), and the tree fixes'
# Triton kernels with the tensor-core row-parallel group GEMMs.
set -u
source benchmarks/gpu_setup.sh
{
echo "## record hash on CUDA: Triton kernel vs torch path (bits)"
python3 benchmarks/check_record_hash.py
echo
python3 benchmarks/bench_probes.py hash-sweep
echo
python3 benchmarks/bench_probes.py launch
echo
overhead_1b 3
} > "$OUT/probes.md" 2>&1
timeout 120 python3 benchmarks/bench_probes.py profile --model llama-1b --dtype bfloat16 --seq 2048 --batch 1 > "$OUT/profile.txt" 2>&1
timeout 200 python3 benchmarks/gpu_tree_kernels.py --out "$OUT" > "$OUT/tree_stdout.txt" 2>&1
echo "tree rc=$?" >> "$OUT/tree_stdout.txt"
rm -f "$OUT"/probes_*.json
cat "$OUT/probes.md"; head -60 "$OUT/profile.txt"; tail -30 "$OUT/tree_kernels.md" 2>/dev/null; tail -3 "$OUT/tree_stdout.txt"
