source benchmarks/gpu_setup.sh
export CUDA_LAUNCH_BLOCKING=1
tb() { for f in $1/tp*/rank*.error; do [ -f $f ] && python3 -c "import json,sys; e=json.load(open('$f')); print('$f', e['traceback'][-2500:])"; done; }
for mode in "hash:" "hash:TPDIAG_HASH_TORCH=1" "full:"; do
  cap=${mode%%:*}; envs=${mode#*:}
  n=dbg-$cap-${envs:+torch}
  env $envs timeout 150 python3 -m tpdiag.cli compare --device cuda --model small-llama --tp 1,2 --capture $cap --no-confirm --no-baseline --out /tmp/m/$n --format json > /tmp/m/$n.json 2>/tmp/m/$n.err
  echo "== $n rc=$?"; show $n /tmp/m; tb /tmp/m/$n
done 2>&1 | tee $OUT/dbg.md | tail -c 6000
