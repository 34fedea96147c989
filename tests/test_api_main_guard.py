"""A user's script that starts tpdiag's worlds from its top-level code, without an
`if __name__ == "__main__":` guard (helper hapi25). Each rank starts by importing the script again
(forkserver and spawn: multiprocessing's spawn.prepare), so every rank re-ran the user's call. Main at
d7f8339 reported the TP > 1 configurations `failed` with `rank 0 died (exit code 1) before finishing
its work` - and each rank had re-run the script's own code (here: rewriting the engine's file) up to a
second call whose traceback was the only hint. Now each rank leaves at the call
(start_context.refuse_rerun) and the caller raises UnguardedMain: one line naming the script and
the fix. With the guard the same script runs every configuration."""
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT

HERE = os.path.dirname(os.path.abspath(__file__))


def _script(name, *args, cwd):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("TPDIAG_START_METHOD", None)  # the default, forkserver (fork would import no script again)
    return subprocess.run([sys.executable, os.path.join(HERE, name), *args], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=300)


def _fix_line(script, who):
    return (f"{who} ran {script} again as {'they' if who.endswith('ranks') else 'it'} started (Python's "
            "forkserver start method imports the main script in every new process), and its top-level code "
            "called tpdiag again: wrap the call in `if __name__ == '__main__':`")


@pytest.mark.parametrize("jobs", [1, 2])  # 1: TP=2's world after TP=1; 2: lanes started first (rollout/early.py)
def test_an_unguarded_rollout_script_fails_with_the_fix_never_a_shorter_result(tmp_path, jobs):
    p = _script("user_rollout_script.py", str(tmp_path), str(jobs), cwd=tmp_path)
    assert p.returncode != 0, p.stdout + p.stderr
    assert "RESULT" not in p.stdout, p.stdout  # no result at all: not one without TP=2
    last = p.stderr.strip().splitlines()[-1]
    assert last == "tpdiag.errors.UnguardedMain: " + _fix_line("user_rollout_script.py", "TP=2's ranks"), p.stderr
    # the ranks left at the call: no rank's traceback from a second run_rollout (it ran the model's
    # checks, read the file the first run was given, and hit multiprocessing's own RuntimeError)
    assert "RuntimeError" not in p.stderr and p.stderr.count("Traceback") == 1, p.stderr
    # the script itself ran here, then once in each rank of TP=2's world (or of its lanes)
    ran = (tmp_path / "ran.txt").read_text().split()
    assert len(ran) >= 3 and len(set(ran)) == len(ran), ran


def test_the_guarded_script_runs_every_configuration(tmp_path):
    p = _script("user_rollout_guarded.py", str(tmp_path), "1", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    got = json.loads([ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")][-1][len("RESULT "):])
    assert got == {"tp1-mb1-prefill-none": "ok", "tp2-mb1-prefill-none": "ok"}, got


def test_an_unguarded_script_that_starts_no_process_runs_as_before(tmp_path):
    # TP=1 alone runs in the script's process: nothing imports the script again, nothing is refused
    p = _script("user_rollout_script.py", str(tmp_path), "1", "1", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    got = json.loads([ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")][-1][len("RESULT "):])
    assert got == {"tp1-mb1-prefill-none": "ok"}, got
    assert len((tmp_path / "ran.txt").read_text().split()) == 1


def test_the_command_line_called_from_an_unguarded_script_is_one_error_line(tmp_path):
    out = tmp_path / "run"
    p = _script("user_compare_script.py", str(out), cwd=tmp_path)
    # DESIGN.md: bad input -> 2; the CLI's one `error:` line, not a compare whose reference "died"
    assert p.returncode == 2, p.stdout + p.stderr
    assert p.stderr.strip().splitlines() == ["error: " + _fix_line("user_compare_script.py", "TP=1's rank")], p.stderr
    assert "Traceback" not in p.stderr and not (out / "summary.json").exists()
