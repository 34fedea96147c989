#!/usr/bin/env bash
# One-GPU batch (nvidia-h200): the record hash on CUDA (bits vs the torch path, throughput),
# probe overhead on a ~1B model, and the fp32 invariant-gemm sweep. Results under $OUT.
set -u
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,driver_version --format=csv > "$OUT/gpu.txt"
{
echo "## record hash on CUDA: Triton kernel vs torch path (bits)"
python3 - <<'PY'
import torch
from tpdiag.kernels import record_hash as rh
torch.manual_seed(0)
bad = 0
for dt in (torch.float32, torch.bfloat16, torch.float16):
    full = torch.randn(8, 300, 4100, device="cuda").to(dt)
    full[0, 0, 0] = float("nan"); full[1, 2, 3] = float("inf")
    for dim in (None, 0, 1, 2):
        parts = [full] if dim is None else list(full.chunk(4, dim=dim))
        off = 0
        tot_t = torch.zeros(3, dtype=torch.int64); tot_k = torch.zeros(3, dtype=torch.int64)
        for p in parts:
            p = p.contiguous()
            args = rh.slab(p.shape, dim, None if dim is None else full.shape[dim], off)
            ia, fa = rh.lanes_torch(p, *args)
            ib, fb = rh.triton_lanes(p, *args)
            tot_t += ia.cpu(); tot_k += ib.cpu()
            bad += int(not torch.equal(ia, ib))
            off += 0 if dim is None else p.shape[dim]
        whole, _ = rh.lanes_torch(full, *rh.slab(full.shape, None, None, 0))
        ok = (tot_k[0] & rh.M32) == whole[0].cpu() and (tot_k[1] & rh.M32) == whole[1].cpu()
        bad += int(not ok)
        print(f"- {dt} shards on dim {dim}: kernel == torch per shard, shares add up to the whole: {ok}")
print(f"mismatches: {bad}")
PY
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
