# sourced by the GPU batch scripts: wheels carried in .whl (no network there), NVLS off
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
nvidia-smi --query-gpu=index,name,clocks.sm,clocks.max.sm,temperature.gpu,driver_version --format=csv > "$OUT/gpu.txt"
# one line per compare: status and first divergence per degree
show() {
  python3 - "$1" "$2" <<'PY'
import json, sys
name, d = sys.argv[1], sys.argv[2]
try:
    s = json.load(open(f"{d}/{name}.json"))
except Exception:
    print(f"| {name} | no summary | {open(f'{d}/{name}.err').read()[-400:]!r} |"); sys.exit()
cells = []
for lab, v in s["degrees"].items():
    fd = v.get("first_divergence") or {}
    c = v.get("confirmation") or {}
    cells.append(f"TP={lab}: {v['status']}" + (f" {fd['phase']}:{fd['module']}({fd['kind']}) op={fd.get('op')} {fd['cause']} max_abs={fd.get('max_abs')}" if fd else "")
                 + (f" confirm[{c.get('fix')}]={c.get('verdict')}" if c else "") + (f" ERR {v.get('error')}" if v.get('error') else ""))
m = json.load(open(f"{d}/{name}/manifest.json"))
walls = {k: w.get("wall_s") for k, w in m.get("worlds", {}).items()}
print(f"| {name} | {s['status']} ({s.get('capture')}) | " + " ; ".join(cells) + f" | worlds wall s {walls} |")
PY
}
# probe overhead on llama-1b bf16 at the small and the larger step (docs/scale.md); $1: rounds
overhead_1b() {
  python3 benchmarks/bench_probes.py overhead --model llama-1b --dtype bfloat16 --seq 2048 --batch 1 --rounds "${1:-3}"
  echo
  python3 benchmarks/bench_probes.py overhead --model llama-1b --dtype bfloat16 --seq 4096 --batch 2 --rounds "${1:-3}"
}
# one compare and its summary line: run_cmp NAME DEGREES LIMIT_S compare-args...
# (a limit under 30 s skips it: the batch's 10-minute budget is spent)
run_cmp() {
  local n=$1 tp=$2 lim=$3; shift 3
  [ "$lim" -lt 30 ] && { echo "| $n | skipped (time) |"; return; }
  local s0=$SECONDS
  mkdir -p /tmp/m
  timeout "$lim" python3 -m tpdiag.cli compare --device cuda --tp "$tp" --out /tmp/m/$n --format json "$@" >/tmp/m/$n.json 2>/tmp/m/$n.err
  echo "| $n | rc=$? wall $((SECONDS - s0)) s |"; show $n /tmp/m
}
# the record hash bit for bit against the torch path, then its host time per record
hash_checks() {
  timeout 120 python3 benchmarks/check_record_hash.py > "$OUT/check_hash.txt" 2>&1; echo "check hash rc=$?"; tail -4 "$OUT/check_hash.txt"
  timeout 120 python3 benchmarks/bench_probes.py launch > "$OUT/launch.md" 2>&1; echo "launch rc=$?"; tail -12 "$OUT/launch.md"
}
# hash-mode overhead A/B on llama-1b bf16, one GPU, into $OUT/overhead.md: three runs (7 rounds)
# at batch 1 x seq 2048, one at batch 2 x seq 4096. $1: modes; $2: extra modes of the first run;
# $3: rounds of the batch-2 run
overhead_ab() {
  {
  for i in 1 2 3; do
    CUDA_VISIBLE_DEVICES=0 timeout 150 python3 benchmarks/bench_probes.py overhead --model llama-1b --dtype bfloat16 \
      --seq 2048 --batch 1 --rounds 7 --modes "$1$([ $i = 1 ] && echo "$2")"
    echo "run $i rc=$?"; echo
  done
  CUDA_VISIBLE_DEVICES=0 timeout 120 python3 benchmarks/bench_probes.py overhead --model llama-1b --dtype bfloat16 \
    --seq 4096 --batch 2 --rounds "$3" --modes "$1"
  echo "bs2 rc=$?"
  } > "$OUT/overhead.md" 2>&1
  grep -E "^\||rc=|overhead:" "$OUT/overhead.md" | grep -v "|---" | tail -30
}
