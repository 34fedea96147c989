#!/usr/bin/env bash
# hf: models on GPUs (NCCL): tiny Llama and Qwen3 from examples/make_tiny_hf.py, fp32 and bf16.
set -u
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
TP=${1:-1,2,4}
python3 -c "import transformers, torch; print('transformers', transformers.__version__, 'torch', torch.__version__)"
for m in llama qwen3; do python3 examples/make_tiny_hf.py $m /tmp/hf-$m >/dev/null; done
for m in llama qwen3; do for dt in float32 bfloat16; do
  python3 -m tpdiag.cli compare --device cuda --model hf:/tmp/hf-$m --tp "$TP" --dtype $dt --no-confirm \
     --out /tmp/hfruns/$m-$dt --format json > /tmp/hfruns-$m-$dt.json 2>/tmp/hfruns-$m-$dt.err
  python3 - "$m-$dt" "/tmp/hfruns-$m-$dt.json" "/tmp/hfruns-$m-$dt.err" <<'PY'
import json, sys
name, path, err = sys.argv[1:]
try:
    s = json.load(open(path))
except Exception:
    print(f"| {name} | no summary | {open(err).read()[-300:]!r} |"); sys.exit()
cells = []
for lab, d in s["degrees"].items():
    fd = d.get("first_divergence") or {}
    lp = d.get("logprobs") or {}
    cells.append(f"TP={lab}: {d['status']} " + (f"{fd['phase']}:{fd['module']}({fd['kind']}) {fd['cause']}" if fd else "")
                 + (f" lp_max={lp['max_abs']:.2e} tmpe={lp['token_mult_prob_error']:.7f}" if lp else "") + (f" ERR {d.get('error')}" if d.get('error') else ""))
print(f"| {name} | {s['status']} | baseline={s.get('baseline',{}).get('reproducible')} | " + " ; ".join(cells) + " |")
PY
done; done
