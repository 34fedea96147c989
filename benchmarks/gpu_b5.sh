#!/usr/bin/env bash
# 1-GPU batch 5 (H200): record hash after the narrow-tile fix (bits, launch shapes, host time,
# overhead at the small step with 5 rounds), then invariant-gemm fp32 - IEEE FMA vs 3xTF32 vs
# pre-split bf16x6/bf16x9 on tensor cores (kernels/split_gemm.py): speed vs cuBLAS, accuracy
# vs float64, invariance.
set -u
source benchmarks/gpu_setup.sh
{
python3 benchmarks/check_record_hash.py | tail -2
python3 benchmarks/bench_probes.py hash-sweep
python3 benchmarks/bench_probes.py launch
python3 benchmarks/bench_probes.py overhead --model llama-1b --dtype bfloat16 --seq 2048 --batch 1 --rounds 5
} > "$OUT/probes2.md" 2>&1
cat "$OUT/probes2.md"
timeout 400 python3 benchmarks/bench_invariant_gemm.py --sweep --dtypes fp32 --inv-dtypes fp32 > "$OUT/gemm_stdout.txt" 2>&1
echo "rc=$?" >> "$OUT/gemm_stdout.txt"
rm -f "$OUT"/probes_*.json
grep -v "^$" "$OUT/gemm_stdout.txt" | tail -70
