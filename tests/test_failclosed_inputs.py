"""Fail closed on inputs, round 2 (issue 58): special and huge files, rollout numbers out of range,
repeated axis values, a closed output pipe. Each case is one line and exit 2 (or the command's own
exit code for the pipe), in seconds, never a hang."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time

import pytest
from conftest import ROOT, on_cpu, run_cli
from typer.testing import CliRunner

# On 9653b56 a FIFO hung these commands: each runs in a process of its own with a deadline.
DEADLINE_S = 60


def _tpdiag(*args, deadline=DEADLINE_S):
    # conftest.run_cli: a process of its own (stdin /dev/null, killed at the deadline), forked
    # from the server that has imported torch rather than a fresh interpreter (~3 s of CPU each)
    t0 = time.monotonic()
    try:
        p = run_cli(*args, env={"COLUMNS": "160"}, timeout=deadline)
    except subprocess.TimeoutExpired:
        pytest.fail(f"tpdiag {' '.join(args)}: still running after {deadline} s (blocked)")
    return p, time.monotonic() - t0


def _one_line_exit_2(p, *words):
    err = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2, (p.returncode, p.stdout[-1000:], p.stderr[-2000:])
    assert len(err) == 1 and "Traceback" not in p.stderr, p.stderr[-2000:]
    for w in words:
        assert w in err[0], (w, err[0])
    return err[0]


# -- special files: a FIFO, /dev/zero --------------------------------------------------------------
def _fifo(tmp_path, name):
    p = tmp_path / name
    os.mkfifo(p)
    return str(p)


@pytest.mark.parametrize("case", ["policy FIFO", "policy /dev/zero", "rollout FIFO", "rollout /dev/zero",
                                  "py: target FIFO"])
def test_special_files_are_refused_at_once(tmp_path, case):
    if case == "policy FIFO":
        f = _fifo(tmp_path, "policy.toml")
        args = ["gate", str(tmp_path), "--policy", f]
    elif case == "policy /dev/zero":
        f = "/dev/zero"
        args = ["gate", str(tmp_path), "--policy", f]
    elif case == "rollout FIFO":
        f = _fifo(tmp_path, "rollout.jsonl")
        args = ["rollout", f, "--model", "tiny-llama", "--device", "cpu"]
    elif case == "rollout /dev/zero":
        f = "/dev/zero"
        args = ["rollout", f, "--model", "tiny-llama", "--device", "cpu"]
    else:
        f = _fifo(tmp_path, "model.py")
        args = ["compare", "--model", f"py:{f}:target", "--tp", "1,2", "--out", str(tmp_path / "run")]
    p, _ = _tpdiag(*args)
    _one_line_exit_2(p, f, "not a regular file")


@pytest.fixture()
def run_copy(tp12_run, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(tp12_run, dst)
    return dst


@pytest.mark.parametrize("name", ["tp2/events.jsonl", "diff.csv", "summary.json"])
def test_a_20_gb_sparse_file_in_the_run_directory_is_refused_in_seconds(run_copy, name):
    """Truncated up to 20 GB (sparse: no disk used): one line naming the file and the limit, exit 2.
    Before: `error: MemoryError:` (empty) or a timeout."""
    os.truncate(run_copy / name, 20 << 30)
    p, took = _tpdiag("gate", str(run_copy))
    out = p.stdout + p.stderr
    assert p.returncode == 2, out[-2000:]
    assert "MemoryError" not in out and str(run_copy / name) in out and "MiB tpdiag reads" in out, out[-2000:]
    assert took < 30, took


def test_no_error_line_is_empty():
    from tpdiag.cli.common import words_for

    for e in (MemoryError(), RecursionError(), KeyError(), ValueError("")):
        w = words_for(e)
        assert w.strip() and len(w) > len(type(e).__name__) + 5, (e, w)


# -- rollout numbers out of range ------------------------------------------------------------------
def _rollout_file(tmp_path, lines, name="r.jsonl"):
    f = tmp_path / name
    f.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return str(f)


def test_non_finite_logprobs_are_one_line_each_before_any_model_runs(tmp_path):
    # JSON's -Infinity and NaN tokens (Python's json reads both); before: -Infinity ran the model and
    # gave exit 0 with token_mult_prob_error inf and k3 KL nan
    good = {"input_ids": [1, 2, 3], "prompt_len": 1, "logprobs": [-0.5, -0.1]}
    f = _rollout_file(tmp_path, [good, '{"input_ids": [1, 2, 3], "prompt_len": 1, "logprobs": [-Infinity, -0.1]}',
                                 good, '{"input_ids": [1, 2, 3], "prompt_len": 1, "logprobs": [-0.5, NaN]}'])
    p, _ = _tpdiag("rollout", f, "--model", "tiny-llama", "--device", "cpu")
    err = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2 and len(err) == 2, p.stderr
    assert "line 2: field 'logprobs[0]': -inf" in err[0] and "line 4: field 'logprobs[1]': nan" in err[1], err


def test_deep_json_is_one_line_naming_the_file(tmp_path):
    f = tmp_path / "deep.json"
    f.write_text("[" * 100000 + "]" * 100000)
    p, _ = _tpdiag("rollout", str(f), "--model", "tiny-llama", "--device", "cpu")
    _one_line_exit_2(p, str(f), "nested too deeply")


def test_sglang_input_logprobs_must_cover_the_prompt(tmp_path):
    """A response asked with logprob_start_len > 0: its input list starts inside the prompt (a number
    where the first prompt token has none); it used to be measured against the truncated prompt."""
    resp = {"meta_info": {"input_token_logprobs": [[-1.5, 7, "c"], [-0.5, 8, "d"]],
                          "output_token_logprobs": [[-0.25, 9, "e"]]}}
    f = _rollout_file(tmp_path, [resp], "sglang.json")
    p, _ = _tpdiag("rollout", f, "--model", "tiny-llama", "--device", "cpu")
    _one_line_exit_2(p, f, "meta_info.input_token_logprobs[0][0]", "logprob_start_len=0")


def test_metrics_never_overflow_and_name_the_tokens_beyond_range():
    """-800 nats from the trainer: before, `OverflowError: math range error` after the model ran."""
    import torch

    from tpdiag.rollout.metrics import summarise
    from tpdiag.rollout.read import Sequence

    seqs = [Sequence([1, 2, 3, 4], 2, [-800.0, -0.5], None, None, "line 1"),
            Sequence([1, 2, 3], 2, [-0.25], None, None, "line 2")]
    trainer = [torch.tensor([-1.0, -0.75, -0.5, -0.1]), torch.tensor([-1.0, -0.25, -0.5])]
    m = summarise(seqs, trainer)
    assert m["token_mult_prob_error"] == float("inf") and m["k3_kl"] == float("inf"), m
    far = m["beyond_range"]
    assert far["tokens"] == 1 and far["first"][0]["where"] == "line 1" and far["first"][0]["position"] == 2, far
    # the ordinary case is summed as it always was
    m = summarise(seqs[1:], trainer[1:])
    assert m["token_mult_prob_error"] == 1.0 and m["k3_kl"] == 0.0 and "beyond_range" not in m, m


# -- repeated axis values --------------------------------------------------------------------------
@pytest.mark.parametrize("args,what", [(["--micro-batch", "2,2"], "--micro-batch '2,2': 2 is listed twice"),
                                       (["--micro-batch", "1,1"], "--micro-batch '1,1': 1 is listed twice"),
                                       (["--mode", "prefill,prefill"], "prefill is listed twice")])
def test_a_repeated_axis_value_is_refused(tmp_path, args, what):
    """Before: a bogus second world of the same configuration ran ("1 bitwise") and the gate then
    called the clean run inconclusive (exit 2)."""
    from tpdiag.cli import app

    out = tmp_path / "run"
    r = CliRunner().invoke(app, on_cpu(["compare", "--tp", "1,2", "--forward-only", "--no-confirm", "--out", str(out), *args]))
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert r.exit_code == 2 and len(lines) == 1 and what in lines[0], r.output
    assert not out.exists()


# -- a closed output pipe --------------------------------------------------------------------------
def test_a_closed_pipe_ends_quietly_with_the_commands_own_exit_code(tp12_run, tmp_path):
    """`tpdiag gate RUN | true`: the reader is gone before the first line is written. The gate's own
    verdict (exit 0 under a policy allowing the run's causes) stands; no BrokenPipeError, no
    "Exception ignored". Before: exit 1, which a CI script reads as a divergence."""
    s = json.loads((tp12_run / "summary.json").read_text())
    causes = {d["first_divergence"]["cause"] for d in s["degrees"].values()}
    causes |= {f["cause"] for d in s["degrees"].values() for f in d.get("findings") or []}
    pol = tmp_path / "allow.toml"
    pol.write_text("allow_causes = [%s]\n" % ", ".join(f'"{c}"' for c in sorted(causes)))
    direct, _ = _tpdiag("gate", str(tp12_run), "--policy", str(pol))
    assert direct.returncode == 0, direct.stdout + direct.stderr
    env = dict(os.environ, COLUMNS="160")
    cmd = f'"{sys.executable}" -m tpdiag.cli gate "{tp12_run}" --policy "{pol}" | true; exit ${{PIPESTATUS[0]}}'
    p = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, cwd=ROOT, env=env, timeout=DEADLINE_S)
    assert p.returncode == 0 and p.stderr.strip() == "", (p.returncode, p.stderr[-2000:])
