#!/usr/bin/env bash
# The GPU matrix for docs/gpu.md: stock and --fix all, fp32 and bf16, NCCL, one call.
# Usage on a lent 4-GPU machine:  bash benchmarks/gpu_compare.sh "1,2,4"
set -u
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
TP=${1:-1,2,4}
OUTD=${OUT:-/tmp/out}
mkdir -p "$OUTD"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version(), 'gpus', torch.cuda.device_count())"
run() {  # name, args...
  local name=$1; shift
  local t0=$(date +%s.%N)
  python3 -m tpdiag.cli compare --device cuda --tp "$TP" --out "/tmp/runs/$name" --format json "$@" > "/tmp/runs/$name.json" 2> "/tmp/runs/$name.err"
  local rc=$?
  local t1=$(date +%s.%N)
  python3 - "$name" "$rc" "$t0" "$t1" <<'PY'
import json, sys
name, rc, t0, t1 = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
try:
    s = json.load(open(f"/tmp/runs/{name}.json"))
except Exception as e:
    print(f"| {name} | rc={rc} | no summary: {open(f'/tmp/runs/{name}.err').read()[-400:]!r} |"); sys.exit()
cells = []
for lab, d in s["degrees"].items():
    fd = d.get("first_divergence") or {}
    lp = d.get("logprobs") or {}
    conf = d.get("confirmation") or {}
    cells.append(f"TP={lab}: {d['status']}" + (f" {fd.get('phase')}:{fd.get('module')}({fd.get('kind')}) {fd.get('cause')} maxabs={fd.get('max_abs'):.2e}" if fd else "")
                 + (f" lp_max={lp.get('max_abs'):.2e} tmpe={lp.get('token_mult_prob_error'):.7f}" if lp else "")
                 + (f" confirm[{conf.get('fix')}]={conf.get('verdict')}" if conf else "")
                 + (f" ERR {d.get('error')}" if d.get("error") else ""))
base = s.get("baseline", {})
print(f"| {name} | {s['status']} | baseline reproducible={base.get('reproducible')} | {t1-t0:.1f} s | " + " ; ".join(cells) + " |")
PY
}
mkdir -p /tmp/runs
echo "| run | status | baseline | wall | per degree |"
echo "|---|---|---|---|---|"
run tiny-fp32       --dtype float32
run tiny-bf16       --dtype bfloat16
run tiny-fp32-fix   --dtype float32  --fix all
run tiny-bf16-fix   --dtype bfloat16 --fix all
run med-fp32        --dtype float32  --model medium-llama --seq-len 256 --batch-size 4
run med-bf16        --dtype bfloat16 --model medium-llama --seq-len 256 --batch-size 4
run med-fp32-fix    --dtype float32  --model medium-llama --seq-len 256 --batch-size 4 --fix all
run med-bf16-fix    --dtype bfloat16 --model medium-llama --seq-len 256 --batch-size 4 --fix all
tar czf "$OUTD/runs.tgz" /tmp/runs/*.json /tmp/runs/*.err /tmp/runs/*/summary.json /tmp/runs/*/manifest.json 2>/dev/null
