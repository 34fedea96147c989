"""Several jobs in one device call: each job a child `python -m benchmarks ...` with its own
time limit inside one budget, its output in $OUT/suite/NN-JOB.log, its result line in the
results file(s) as usual. Set for every job: NCCL_NVLS_ENABLE=0 (NVLink multicast off: the
lent machines' NCCL hangs or fails with it), PYTHONUNBUFFERED=1; wheels carried in .whl/ (the
device machine has no network) are installed into /tmp/site and put first on PYTHONPATH;
`nvidia-smi` (clocks, temperature, driver) goes to $OUT/gpu.txt.

    python -m benchmarks suite --preset gpu1
    python -m benchmarks suite "record-hash" "CUDA_VISIBLE_DEVICES=0 probes overhead --rounds 5" "fix-cost --tp 2"
    python -m benchmarks suite --smoke          # the smoke preset on CPU: every job's code path

A job line is what follows `python -m benchmarks`, optionally after VAR=VALUE words (its env).
Exit 1 if a job exited non-zero (under --smoke: other than 3, "needs CUDA").
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time

from benchmarks.proc import run_group

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PRESETS = {
    # one GPU (nvidia-h100-x1 / nvidia-h200): hash bits and costs, probe overhead with MFU, kernels
    "gpu1": ["record-hash", "probes launch", "probes hash",
             "probes overhead --model llama-1b --dtype bfloat16 --batch 1 --seq 2048 --rounds 5",
             # full mode keeps every activation: at the GPU-bound size only hash is compared
             "probes overhead --model llama-1b --dtype bfloat16 --batch 8 --seq 4096 --rounds 3 --modes none,hash",
             "tree-kernels", "gemm"],
    # 2 GPUs: the fix cost at TP=2 (both sizes), --fix all bitwise at TP=1,2, llama-1b compare
    "gpu2": ["fix-cost --tp 2", "compare --set fix-all --tp 1,2 --only tiny-bfloat16-fix,med-float32-fix",
             "compare-1b --tp 1,2"],
    # 4 GPUs: the fix cost at TP=2,4 (both sizes) and llama-1b compare at TP=1,2,4
    "gpu4": ["fix-cost --tp 2,4", "compare-1b --tp 1,2,4"],
    # CPU: every job's code path at tiny size (CUDA-only jobs must say so and exit 3)
    "smoke": ["probes overhead --smoke",
              "fix-cost --smoke --tp 1,2 --sizes 1x16 --iters 1 --warmup 1 --no-each",
              "compare --smoke", "tree-kernels --smoke --dtypes fp32", "gemm --smoke --dtypes fp32 --inv-dtypes fp32",
              "record-hash", "split-gemm", "probes hash"],
}
ENV_WORD = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


def parse(argv):
    p = argparse.ArgumentParser(prog="benchmarks suite", description=__doc__.splitlines()[0])
    p.add_argument("lines", nargs="*", help="job lines, e.g. \"fix-cost --tp 2\"")
    p.add_argument("--preset", choices=sorted(PRESETS), action="append", default=[])
    p.add_argument("--budget", type=int, default=570, help="seconds for the whole suite (a device call: 600)")
    p.add_argument("--job-timeout", type=int, default=400, help="seconds one job may take")
    p.add_argument("--smoke", action="store_true", help="= --preset smoke; exit 3 (needs CUDA) counts as ok")
    args = p.parse_args(argv)
    if args.smoke:
        args.preset.append("smoke")
    args.jobs = [ln for pr in args.preset for ln in PRESETS[pr]] + args.lines
    if not args.jobs:
        p.error("no jobs: give job lines or --preset (" + ", ".join(PRESETS) + ")")
    return args


def setup_env(out: str | None) -> dict:
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", PYTHONUNBUFFERED="1")
    path = [ROOT]
    wheels = glob.glob(os.path.join(ROOT, ".whl", "*.whl"))
    if wheels:
        r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                            "--no-cache-dir", "--upgrade", "--target", "/tmp/site", *wheels],
                           capture_output=True, text=True)
        print(f"wheels from .whl: {len(wheels)}, pip rc={r.returncode} {r.stderr.strip()[-300:]}")
        path.insert(0, "/tmp/site")
    env["PYTHONPATH"] = os.pathsep.join(path + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    _bytecode(["/tmp/site"] if wheels else [])
    if out:
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=index,name,clocks.sm,clocks.max.sm,temperature.gpu,"
                                  "driver_version", "--format=csv"], capture_output=True, text=True, timeout=30)
            with open(os.path.join(out, "gpu.txt"), "w") as f:
                f.write(smi.stdout)
        except (OSError, subprocess.SubprocessError):
            pass
    return env


def _bytecode(extra: list[str]) -> None:
    """Every module's bytecode, as a pip install leaves it: the lent machines' image ships torch
    without it and sets PYTHONDONTWRITEBYTECODE, so every process that imported torch compiled
    ~1700 modules from source (5.4 s of a compare's parent at bb2f420, cProfile) - a cost no
    user's install has. Compiled once here, before any job; timed and printed."""
    import sysconfig

    where = [sysconfig.get_paths()["purelib"], *extra]
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "compileall", "-q", "-j", "0", *where],
                       capture_output=True, text=True)
    print(f"bytecode: compileall {' '.join(where)} rc={r.returncode} in {time.perf_counter() - t0:.1f} s "
          f"(PYTHONDONTWRITEBYTECODE={os.environ.get('PYTHONDONTWRITEBYTECODE', '')!r}) {r.stderr.strip()[-200:]}")


def main(argv: list[str]) -> dict:
    args = parse(argv)
    out = os.environ.get("OUT")
    logs = os.path.join(out, "suite") if out else None
    if logs:
        os.makedirs(logs, exist_ok=True)
    env = setup_env(out)
    t_start = time.monotonic()
    rows = []
    for i, line in enumerate(args.jobs):
        words = shlex.split(line)
        job_env = {}
        while words and ENV_WORD.match(words[0]):
            k, v = words.pop(0).split("=", 1)
            job_env[k] = v
        left = int(args.budget - (time.monotonic() - t_start))
        limit = min(args.job_timeout, left)
        name = words[0] if words else "?"
        if limit < 20:
            rows.append({"job": line, "rc": None, "wall_s": 0, "note": "skipped (budget spent)"})
            print(f"== [{i}] {line}: skipped (budget spent)")
            continue
        print(f"== [{i}] {line} (limit {limit} s)", flush=True)
        t0 = time.monotonic()
        # streamed to the log as it runs: a device call cut off at its limit keeps what was printed
        log = os.path.join(logs, f"{i:02d}-{name}.log") if logs else os.path.join(
            tempfile.gettempdir(), f"benchmarks-suite-{os.getpid()}-{i:02d}.log")
        with open(log, "w") as f:
            rc, _, _ = run_group([sys.executable, "-m", "benchmarks", *words], limit, cwd=ROOT,
                                 env={**env, **job_env}, stdout=f, stderr=subprocess.STDOUT)
        with open(log) as f:
            text = f.read()
        if rc == 124:
            text += f"\n[suite] killed after {limit} s"
        wall = time.monotonic() - t0
        tail = "\n".join(text.rstrip().splitlines()[-25:])
        print(tail)
        print(f"== [{i}] rc={rc} wall {wall:.1f} s", flush=True)
        rows.append({"job": line, "rc": rc, "wall_s": round(wall, 1)})
    okrc = (0, 3) if args.smoke else (0,)
    print("\n| job | rc | wall s |\n|---|---|---|")
    for r in rows:
        print(f"| {r['job']} | {r['rc'] if r['rc'] is not None else r.get('note')} | {r['wall_s']} |")
    return {"jobs": rows, "ok": all(r["rc"] in okrc for r in rows)}
