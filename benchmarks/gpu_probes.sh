#!/usr/bin/env bash
# One-GPU batch (nvidia-h200): the record hash on CUDA (bits vs the torch path, throughput),
# probe overhead on a ~1B model, and the fp32 invariant-gemm sweep. Results under $OUT.
set -u
source benchmarks/gpu_setup.sh
{
echo "## record hash on CUDA: Triton kernel vs torch path (bits)"
python3 benchmarks/check_record_hash.py
echo
python3 benchmarks/bench_probes.py hash
echo
python3 benchmarks/bench_probes.py overhead --model llama-1b --dtype bfloat16 --seq 2048 --batch 1 --rounds 3
echo
python3 benchmarks/bench_probes.py overhead --model medium-llama --dtype float32 --seq 2048 --batch 2 --rounds 3
} > "$OUT/probes.md" 2>&1
timeout 300 python3 benchmarks/bench_invariant_gemm.py --sweep --dtypes fp32 --inv-dtypes fp32 > "$OUT/gemm_stdout.txt" 2>&1
echo "gemm rc=$?" >> "$OUT/gemm_stdout.txt"
tail -c 3000 "$OUT/probes.md"
