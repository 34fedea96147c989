"""The fork server starts before the input is checked (runner/start_context.prestart): its imports -
torch, transformers for an hf: model - overlap the parent's checks instead of the first world's
start. TPDIAG_PRESTART=0 turns it off (A/B), and a bad input is still one line, exit 2."""
from __future__ import annotations

import os
import subprocess
import sys

from conftest import ROOT

CODE = """
import multiprocessing.forkserver as fs
from tpdiag.runner.start_context import prestart
prestart("tiny-llama")
print("running" if fs._forkserver._forkserver_pid is not None else "not running")
"""


def _run(env_extra: dict) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("TPDIAG_START_METHOD", "TPDIAG_PRESTART")}
    env.update(PYTHONPATH=ROOT, **env_extra)
    p = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    return p.stdout.strip().splitlines()[-1]


def test_prestart_starts_the_fork_server_and_can_be_turned_off():
    assert _run({}) == "running"
    assert _run({"TPDIAG_PRESTART": "0"}) == "not running"
    assert _run({"TPDIAG_START_METHOD": "spawn"}) == "not running"


def test_bad_input_after_prestart_is_still_one_line_exit_2():
    env = dict(os.environ, PYTHONPATH=ROOT)
    p = subprocess.run([sys.executable, "-m", "tpdiag", "compare", "--device", "cpu", "--model", "no-such-model",
                        "--tp", "1,2"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    assert len(p.stderr.strip().splitlines()) == 1 and "no-such-model" in p.stderr, p.stderr


def test_unknown_start_method_is_one_line_exit_2():
    env = dict(os.environ, PYTHONPATH=ROOT, TPDIAG_START_METHOD="bogus")
    p = subprocess.run([sys.executable, "-m", "tpdiag", "compare", "--device", "cpu", "--tp", "1,2"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    assert len(p.stderr.strip().splitlines()) == 1 and "TPDIAG_START_METHOD" in p.stderr, p.stderr


def test_prestart_leaves_this_process_threads_alone_and_gives_ranks_the_rank_env():
    """RANK_ENV (OMP_NUM_THREADS=1, ...) reaches the fork server - so every rank - but not the
    parent, where the diff runs: torch imported after prestart keeps its default thread count."""
    code = """
import os
import multiprocessing as mp
from tpdiag.runner.start_context import prestart
prestart("tiny-llama")
import torch
print(torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS"))
ctx = mp.get_context("forkserver")  # the server prestart started: a rank's parent
p = ctx.Process(target=exec, args=("import os, sys; sys.exit(0 if os.environ.get('OMP_NUM_THREADS') == '1' else 3)",))
p.start(); p.join()
print(p.exitcode)
"""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS",
                                                          "TPDIAG_START_METHOD", "TPDIAG_PRESTART")}
    env["PYTHONPATH"] = ROOT
    plain = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
                           capture_output=True, text=True, env=env, timeout=120)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    lines = p.stdout.split("\n")
    threads, omp = lines[0].split()
    assert threads == plain.stdout.strip() and omp == "None", (p.stdout, plain.stdout)
    assert lines[1].strip() == "0", p.stdout  # the rank had OMP_NUM_THREADS=1
