"""A rank sees its launcher's environment as its world starts (runner/start_context.rank_entry).
Ranks are fork-server children, and the server's environment is fixed at its start (the process's
first world, or prestart): a variable set after it - a user's model file reading its checkpoint's
path, set by a notebook or a test between runs - reached no rank. tests/test_rl_glm4_trial.py's
TP=2 world failed so (its `py:` file's os.environ["USER_GLM4_DIR"]: KeyError in each rank, the
configuration without metrics) whenever an earlier test in the same process had started the server."""
import json
import os
import subprocess
import sys

from conftest import ROOT

CODE = """
import json, os, sys
from tpdiag.config import WorldConfig
from tpdiag.runner.launch import run_world
from tpdiag.runner.start_context import prestart
import late_env_rank

prestart("tiny-llama")  # the server starts now, without the variable
os.environ["TPDIAG_TEST_LATE_VAR"] = "set-after-the-server"
out = sys.argv[1]
cfg = WorldConfig.of(model="tiny-llama", degree=2, label="2", out_dir=out, device="cpu")
res = run_world(cfg, 60.0, entry=late_env_rank.main)
print(json.dumps([res.status] + [json.load(open(os.path.join(out, f"rank{r}.done")))["late"] for r in range(2)]))
"""


def test_a_variable_set_after_the_fork_server_started_reaches_the_ranks(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("TPDIAG_START_METHOD", "TPDIAG_PRESTART",
                                                           "TPDIAG_TEST_LATE_VAR")}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, os.path.join(ROOT, "tests")])
    p = subprocess.run([sys.executable, "-c", CODE, str(tmp_path)], capture_output=True, text=True, env=env,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads(p.stdout.strip().splitlines()[-1]) == ["ok", "set-after-the-server", "set-after-the-server"]
