"""`tpdiag compare` runs on the device machine, one summary row each: exit code, wall time,
verdict, per degree the first divergence (phase:module(kind), op, cause, max_abs), the
confirmation and the worlds' wall times. Named sets of runs (--set):

  1b       llama-1b bf16, batch 1 x seq 2048, default flow (auto capture, reference rerun,
           region pass, confirmation; strict determinism) - `compare-1b`
  1b-op    llama-1b, --granularity auto: the op drill-down of a divergence (TP=1,4)
  matrix   tiny / medium-llama x fp32 / bf16 x stock / --fix all (docs/gpu.md's matrix)
  fix-all  --fix all --no-confirm, tiny and medium-llama, fp32 and bf16: bitwise expected
  hash     --capture hash: medium bf16 stock, tiny bf16 and medium fp32 with --fix all
  hf       tiny hf: Llama and Qwen3 (examples/make_tiny_hf.py), fp32 and bf16
  4b       Qwen3-4B-shaped hf: (make_tiny_hf.py --shape qwen3-4b), bf16, batch 2 x seq 1024: issue
           #20's command (--no-confirm), the same from a safetensors checkpoint, and the default flow
  more     sequence parallelism, hf: with --fix all, --granularity auto
  oom      llama-1b fp32 under TPDIAG_CUDA_MEM_FRACTION=0.07: a real CUDA OOM, reported cleanly
  axes     the RL axes (issue #39 item 5): llama-1b bf16 --micro-batch 8,1 (and 8,4,2,1:
           mb8421-8x4096) at 8 x 4096 and
           --mode prefill,decode at 1 x 2048 (default flow, TP=1, one GPU); --fix all along each
           axis at smaller sizes (--tp 1,2 --grid for decode: two GPUs)
  smoke    tiny-llama fp32 on CPU (gloo), no baseline/confirmation: the job's code path
  start    tiny hf: Qwen3 fp32, the fork server started before the input checks or with the first
           world (TPDIAG_PRESTART=1 / 0), three pairs alternating: the first world's start (CPU
           ranks work: --device cpu)
  start-4b the same A/B, two pairs, with 4b's safetensors checkpoint at --tp 1,1 (two TP=1 worlds:
           one GPU): the first world's start at issue #20's size
  time     where the time goes (manifest.json time_breakdown, printed per run): llama-1b bf16
           1 x 2048 and a Llama-3.1-8B-shaped hf: config (make_tiny_hf.py --shape llama-8b) cut to
           its first 4 layers (--layers 4), then the whole 8B (8b), and a 70B-shaped one's first 4
           layers (t-70b-4l); default --tp 1,1 (two TP=1
           worlds: one GPU) - `time-breakdown`

    python -m benchmarks compare-1b [--tp 1,2,4]
    python -m benchmarks compare --set matrix --tp 1,2,4
    python -m benchmarks compare --smoke                 # = --set smoke --device cpu --tp 1,2

Run directories go under --work (default /tmp/bench-compare); with $OUT set, each run's
summary.json / manifest.json and the tail of its stderr are copied to $OUT/compare/.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

from benchmarks.proc import run_group

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY_HF = os.path.join(ROOT, "examples", "make_tiny_hf.py")
MED = ["--model", "medium-llama", "--seq-len", "256", "--batch-size", "4"]
Q4B = ["--model", "hf:/tmp/hf-qwen3-4b", "--dtype", "bfloat16", "--seq-len", "1024", "--batch-size", "2"]
L8B = ["--model", "hf:/tmp/hf-llama-8b", "--dtype", "bfloat16", "--seq-len", "2048", "--batch-size", "1"]
L70B = ["--model", "hf:/tmp/hf-llama-70b", "--dtype", "bfloat16", "--seq-len", "2048", "--batch-size", "1"]
L1B = ["--model", "llama-1b", "--dtype", "bfloat16", "--seq-len", "2048", "--batch-size", "1"]

# set -> [(name, compare args, extra env, seconds)]; tp None: the set's --tp
SETS: dict[str, list[tuple]] = {
    "1b": [("l1b", L1B, {}, 420)],
    "1b-op": [("l1b-op", L1B + ["--granularity", "auto", "--no-confirm", "--no-baseline"], {}, 420)],
    "matrix": [(f"{m}-{dt}{'-fix' if fix else ''}", (["--dtype", dt] + (MED if m == "med" else [])
                                                     + (["--fix", "all"] if fix else [])), {}, 240)
               for m in ("tiny", "med") for fix in (False, True) for dt in ("float32", "bfloat16")],
    "fix-all": [(f"{m}-{dt}-fix", ["--dtype", dt, "--fix", "all", "--no-confirm"] + (MED if m == "med" else []),
                 {}, 240) for m in ("tiny", "med") for dt in ("float32", "bfloat16")],
    "hash": [("med-bf16-hash", MED + ["--dtype", "bfloat16", "--capture", "hash"], {}, 200),
             ("tiny-bf16-fix-hash", ["--dtype", "bfloat16", "--fix", "all", "--capture", "hash", "--no-confirm"],
              {}, 150),
             ("med-fp32-fix-hash", MED + ["--dtype", "float32", "--fix", "all", "--capture", "hash", "--no-confirm"],
              {}, 240)],
    "hf": [(f"hf-{m}-{dt}", ["--model", f"hf:/tmp/hf-{m}", "--dtype", dt, "--no-confirm"], {}, 200)
           for m in ("llama", "qwen3") for dt in ("float32", "bfloat16")],
    "more": [("sp-fp32-fix", ["--variant", "sp", "--dtype", "float32", "--fix", "all", "--no-confirm"], {}, 200),
             ("sp-bf16", ["--variant", "sp", "--dtype", "bfloat16", "--no-baseline"], {}, 200),
             ("hf-llama-bf16-fix", ["--model", "hf:/tmp/hf-llama", "--dtype", "bfloat16", "--fix", "all",
                                    "--no-confirm"], {}, 200),
             ("hf-qwen3-fp32-fix", ["--model", "hf:/tmp/hf-qwen3", "--dtype", "float32", "--fix", "all",
                                    "--no-confirm"], {}, 200),
             ("med-fp32-auto", MED + ["--granularity", "auto", "--no-confirm", "--no-baseline"], {}, 200),
             ("med-bf16-auto", MED + ["--dtype", "bfloat16", "--granularity", "auto", "--no-confirm",
                                      "--no-baseline"], {}, 200)],
    "4b": [("4b", Q4B + ["--no-confirm"], {}, 240),
           ("4b-st", ["--model", "hf:/tmp/hf-qwen3-4b-st"] + Q4B[2:] + ["--no-confirm"], {}, 240),
           ("4b-confirm", Q4B, {}, 300)],
    "oom": [("oom", ["--model", "llama-1b", "--dtype", "float32", "--seq-len", "1024", "--batch-size", "1",
                     "--no-confirm", "--no-baseline"], {"TPDIAG_CUDA_MEM_FRACTION": "0.07"}, 100)],
    # a run's own --tp comes after the set's and wins (click keeps an option's last value)
    "axes": [("mb-8x4096", ["--model", "llama-1b", "--dtype", "bfloat16", "--batch-size", "8", "--seq-len", "4096",
                            "--micro-batch", "8,1"], {}, 300),
             # issue #59: the second pass's diff of whole tensors (73 s of 192 s at 7623391)
             ("mb8421-8x4096", ["--model", "llama-1b", "--dtype", "bfloat16", "--batch-size", "8", "--seq-len",
                                "4096", "--micro-batch", "8,4,2,1"], {}, 420),
             ("decode-1x2048", L1B + ["--mode", "prefill,decode", "--forward-only"], {}, 480),
             # the same without the own-input judgement of the modules after the first divergence
             # (57 of them at a63e3e7: their region pass runs every position, then one more pass)
             ("decode-1x2048-first", L1B + ["--mode", "prefill,decode", "--forward-only", "--no-judge-downstream"],
              {}, 300),
             ("mb-fix", ["--model", "llama-1b", "--dtype", "bfloat16", "--batch-size", "4", "--seq-len", "1024",
                         "--micro-batch", "4,1", "--fix", "all", "--no-confirm"], {}, 240),
             ("mb-fix-grid", ["--model", "llama-1b", "--dtype", "bfloat16", "--batch-size", "2", "--seq-len", "512",
                              "--micro-batch", "2,1", "--fix", "all", "--no-confirm", "--no-baseline", "--tp", "1,2",
                              "--grid"], {}, 240),
             ("decode-fix", ["--model", "llama-1b", "--dtype", "bfloat16", "--batch-size", "1", "--seq-len", "256",
                             "--mode", "prefill,decode", "--forward-only", "--fix", "all", "--no-confirm",
                             "--no-baseline", "--tp", "1,2", "--grid"], {}, 240),
             ("decode-fix-hf", ["--model", "hf:/tmp/hf-llama", "--dtype", "bfloat16", "--mode", "prefill,decode",
                                "--forward-only", "--fix", "all", "--no-confirm", "--tp", "1,2", "--grid"], {}, 200)],
    # issue #59 item 1: each run's breakdown (setup, worlds, rerun, diff, second pass, confirmations;
    # model build, float64, Triton compiles) is printed after the table
    "time": [("t-l1b", L1B, {}, 150), ("t-8b-4l", L8B + ["--layers", "4"], {}, 150), ("t-8b", L8B, {}, 300),
             # issue #59 item 3: a 70B-shaped config does not fit TP=1; its first 4 layers with the
             # real embedding and head (--layers 4) do
             ("t-70b-4l", L70B + ["--layers", "4"], {}, 300)],
    "smoke": [("smoke-fp32", ["--dtype", "float32", "--no-baseline", "--no-confirm"], {}, 240)],
    # the fork server started before the input checks (runner/launch.prestart) or, as before, with
    # the first world: A/B pairs, alternating; read each run's first world's spawn_s and start
    "start": [(f"start-{ab}-{i}", ["--model", "hf:/tmp/hf-qwen3", "--dtype", "float32", "--no-confirm"],
               {"TPDIAG_PRESTART": "0" if ab == "before" else "1"}, 200)
              for i in (1, 2, 3) for ab in ("before", "prestart")],
    # the same A/B at issue #20's size on one GPU: the 4B config from its safetensors checkpoint
    # (the first world that took 18.2 s, 9.7 s of it the spawn), at --tp 1,1 - two TP=1 worlds,
    # so the first world is compare's reference world as in `4b-st` without a second GPU
    "start-4b": [(f"start4b-{ab}-{i}", ["--model", "hf:/tmp/hf-qwen3-4b-st"] + Q4B[2:] + ["--no-confirm"],
                  {"TPDIAG_PRESTART": "0" if ab == "before" else "1"}, 240)
                 for i in (1, 2) for ab in ("before", "prestart")],
}
WORLD_KEYS = ("spawn_s", "setup_s", "process_group_s", "model_s", "world_start_s", "selfcheck_s", "steps_s",
              "gather_s", "write_s", "init", "init_full_peak_bytes", "init_whole_bytes", "peak_mem_bytes",
              "max_rss_bytes")
DEFAULT_TP = {"time": "1,1", "axes": "1", "1b-op": "1,4", "4b": "1,2", "oom": "4,2,1", "smoke": "1,2", "start": "1,2", "start-4b": "1,1"}


def parse(argv):
    p = argparse.ArgumentParser(prog="benchmarks compare", description=__doc__.splitlines()[0])
    p.add_argument("--set", dest="set_", choices=sorted(SETS), default="matrix")
    p.add_argument("--tp", default=None, help="degrees (default 1,2,4; 1b-op 1,4; oom 4,2,1; smoke 1,2)")
    p.add_argument("--only", default=None, help="comma list of run names within the set")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--work", default="/tmp/bench-compare", help="directory for the run directories")
    p.add_argument("--budget", type=int, default=0,
                   help="seconds for the whole set (0: none); a run that would get under 30 s is skipped")
    p.add_argument("--smoke", action="store_true", help="= --set smoke --device cpu (gloo), TP=1,2")
    args = p.parse_args(argv)
    if args.smoke:
        args.set_, args.device = "smoke", "cpu"
    args.tp = args.tp or DEFAULT_TP.get(args.set_, "1,2,4")
    runs = SETS[args.set_]
    if args.only:
        names = args.only.split(",")
        unknown = [n for n in names if n not in {r[0] for r in runs}]
        if unknown:
            p.error(f"--only {','.join(unknown)}: not in set {args.set_} ({', '.join(r[0] for r in runs)})")
        runs = [r for r in runs if r[0] in names]
    args.runs = runs
    return args


def summary_row(name: str, rc: int, wall: float, run_dir: str, err_path: str) -> dict:
    row = {"run": name, "rc": rc, "wall_s": round(wall, 1)}
    try:
        s = json.load(open(os.path.join(run_dir, "summary.json")))
    except (OSError, ValueError):
        try:
            tail = open(err_path).read()[-400:]
        except OSError:
            tail = ""
        row["error"] = " ".join(tail.split())[-300:] or "no summary.json"
        return row
    row.update(status=s.get("status"), capture=s.get("capture"),
               baseline_reproducible=(s.get("baseline") or {}).get("reproducible"))
    for k in ("second_pass_worlds", "second_pass_phases", "own_pass_worlds", "own_pass_phases"):
        if (s.get("timings") or {}).get(k):
            row[k] = s["timings"][k]
    degrees = {}
    for lab, d in [*(s.get("degrees") or {}).items(), *(s.get("configurations") or {}).items()]:
        fd = d.get("first_divergence") or {}
        c = d.get("confirmation") or {}
        lp = d.get("logprobs") or {}
        degrees[lab] = {k: v for k, v in {
            "status": d.get("status"),
            "first": f"{fd.get('phase')}:{fd.get('module')}({fd.get('kind')})" if fd else None,
            "op": fd.get("op"), "cause": fd.get("cause"), "max_abs": fd.get("max_abs"),
            "confirm": f"{c.get('fix')}={c.get('verdict')}" if c else None,
            "logprob_max_abs": lp.get("max_abs"), "error": d.get("error")}.items() if v is not None}
    row["degrees"] = degrees
    try:
        m = json.load(open(os.path.join(run_dir, "manifest.json")))
        row["worlds_wall_s"] = {k: w.get("wall_s") for k, w in (m.get("worlds") or {}).items()}
        # where the time and memory go (docs/scale.md's tables): phases, and per world its start,
        # which init path ran and the GPU peak
        row["phases"] = m.get("phases")
        row["time_breakdown"] = m.get("time_breakdown")
        row["worlds"] = {k: {t: v for t, v in (w.get("timings") or {}).items() if t in WORLD_KEYS}
                         for k, w in (m.get("worlds") or {}).items()}
    except (OSError, ValueError):
        pass
    return row


def line(r: dict) -> str:
    if "error" in r and "degrees" not in r:
        return f"| {r['run']} | rc={r['rc']} | {r['wall_s']} s | no summary: {r['error']} |"
    cells = []
    for lab, d in r["degrees"].items():
        cells.append(f"TP={lab}: {d.get('status')}" + (f" {d['first']} op={d.get('op')} {d.get('cause')} "
                                                       f"max_abs={d.get('max_abs')}" if "first" in d else "")
                     + (f" confirm[{d['confirm']}]" if "confirm" in d else "")
                     + (f" ERR {d['error']}" if "error" in d else ""))
    return (f"| {r['run']} | rc={r['rc']} | {r['wall_s']} s | {r.get('status')} ({r.get('capture')}) | "
            + " ; ".join(cells) + f" | {r.get('worlds_wall_s')} |")


def main(argv: list[str]) -> dict:
    args = parse(argv)
    if args.device == "cuda":
        from benchmarks.errors import require_cuda

        require_cuda("compare", "--smoke (or --device cpu) runs it on CPU with gloo")
    if any(a.startswith("hf:") for r in args.runs for a in r[1]):
        for m in ("llama", "qwen3"):
            subprocess.run([sys.executable, TINY_HF, m, f"/tmp/hf-{m}"], check=True, capture_output=True)
        made = {"hf:/tmp/hf-qwen3-4b": ("qwen3", "qwen3-4b", []),
                "hf:/tmp/hf-qwen3-4b-st": ("qwen3", "qwen3-4b", ["--weights"]),
                "hf:/tmp/hf-llama-8b": ("llama", "llama-8b", []),
                "hf:/tmp/hf-llama-70b": ("llama", "llama-70b", [])}
        for target, (kind, shape, extra) in made.items():
            if any(target in r[1] for r in args.runs):
                t0 = time.monotonic()
                subprocess.run([sys.executable, TINY_HF, kind, target[3:], "--shape", shape, *extra],
                               check=True, capture_output=True)
                print(f"wrote {target[3:]} in {time.monotonic() - t0:.1f} s", flush=True)
    os.makedirs(args.work, exist_ok=True)
    out = os.environ.get("OUT")
    t_start = time.monotonic()
    rows = []
    print(f"compare --set {args.set_} --tp {args.tp} --device {args.device}")
    print("| run | rc | wall | status (capture) | per degree | worlds wall s |\n|---|---|---|---|---|---|")
    for name, cargs, env, limit in args.runs:
        if args.budget:
            limit = min(limit, int(args.budget - (time.monotonic() - t_start)))
            if limit < 30:
                rows.append({"run": name, "rc": None, "wall_s": 0, "error": "skipped (budget spent)"})
                print(f"| {name} | skipped (budget spent) |")
                continue
        run_dir = os.path.join(args.work, name)
        shutil.rmtree(run_dir, ignore_errors=True)
        cmd = [sys.executable, "-m", "tpdiag.cli", "compare", "--device", args.device, "--tp", args.tp,
               "--out", run_dir, "--format", "json", *cargs]
        err_path = run_dir + ".err"
        t0 = time.monotonic()
        with open(run_dir + ".json", "w") as so, open(err_path, "w") as se:
            rc = run_group(cmd, limit, stdout=so, stderr=se, env={**os.environ, **env}, cwd=ROOT)[0]
        row = summary_row(name, rc, time.monotonic() - t0, run_dir, err_path)
        row["args"] = " ".join(cargs)
        rows.append(row)
        print(line(row), flush=True)
        if out:
            d = os.path.join(out, "compare")
            os.makedirs(d, exist_ok=True)
            for f in ("summary.json", "manifest.json"):
                if os.path.exists(os.path.join(run_dir, f)):
                    shutil.copy(os.path.join(run_dir, f), os.path.join(d, f"{name}_{f}"))
            with open(err_path) as f_err, open(os.path.join(d, f"{name}_err_tail.txt"), "w") as f_out:
                f_out.write(f_err.read()[-1500:])
    for r in rows:  # where each run's time went (tpdiag compare --verbose's lines)
        if r.get("time_breakdown"):
            from tpdiag.cli.timing import time_lines

            print(f"\n{r['run']} ({r.get('args')}):")
            print("\n".join(time_lines({"time_breakdown": r["time_breakdown"]})), flush=True)
    return {"set": args.set_, "tp": args.tp, "device": args.device, "runs": rows,
            "ok": all(r["rc"] == 0 for r in rows)}
