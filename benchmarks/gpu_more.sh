#!/usr/bin/env bash
# Second GPU batch: sequence parallelism, hf: models with --fix all, op-level drill-down.
set -u
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
TP=${1:-1,2,4}
for m in llama qwen3; do python3 examples/make_tiny_hf.py $m /tmp/hf-$m >/dev/null; done
show() {
  python3 - "$1" <<'PY'
import json, sys
name = sys.argv[1]
try:
    s = json.load(open(f"/tmp/m/{name}.json"))
except Exception:
    print(f"| {name} | no summary | {open(f'/tmp/m/{name}.err').read()[-300:]!r} |"); sys.exit()
cells = []
for lab, d in s["degrees"].items():
    fd = d.get("first_divergence") or {}
    c = d.get("confirmation") or {}
    cells.append(f"TP={lab}: {d['status']}" + (f" {fd['phase']}:{fd['module']}({fd['kind']}) op={fd.get('op')} {fd['cause']}" if fd else "")
                 + (f" confirm[{c.get('fix')}]={c.get('verdict')}" if c else "") + (f" ERR {d.get('error')}" if d.get('error') else ""))
print(f"| {name} | {s['status']} | " + " ; ".join(cells) + " |")
PY
}
mkdir -p /tmp/m
run() { local n=$1; shift; python3 -m tpdiag.cli compare --device cuda --tp "$TP" --out /tmp/m/$n --format json "$@" >/tmp/m/$n.json 2>/tmp/m/$n.err; show $n; }
run sp-fp32-fix   --variant sp --dtype float32 --fix all --no-confirm
run sp-bf16       --variant sp --dtype bfloat16 --no-baseline
run hf-llama-bf16-fix --model hf:/tmp/hf-llama --dtype bfloat16 --fix all --no-confirm
run hf-qwen3-fp32-fix --model hf:/tmp/hf-qwen3 --dtype float32 --fix all --no-confirm
run med-fp32-auto --model medium-llama --seq-len 256 --batch-size 4 --granularity auto --no-confirm --no-baseline
run med-bf16-auto --model medium-llama --seq-len 256 --batch-size 4 --dtype bfloat16 --granularity auto --no-confirm --no-baseline
