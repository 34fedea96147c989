"""A grad hook the user's own parallelize_module drops, in a `tpdiag.capture` (helper hstep16;
tests/models/planted/capture_hook.py). tpdiag never sees the model before the user's plan, so the
runner's check (models/grad_hooks.dropped_hooks) cannot run; each capture records the hooks on the
parameters it was handed and which are DTensors (world.json param_hooks, dtensor_params), and
`tpdiag diff` names the hook the TP=2 capture's DTensor weight lacks. At df55e0a the halved grad
read "a loss or grad divided or multiplied by another count", the hook unnamed; the twin that
registers it after the plan reads rounding."""
import json
import os

import pytest

from conftest import run_cli, run_module

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "models", "planted", "capture_hook.py")


def _capture(nproc: int, out, when: str) -> None:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    p = run_module("torch.distributed.run", "--standalone", "--nproc-per-node",
                   str(nproc), SCRIPT, "--out", str(out), "--when", when, env=env, cwd=ROOT, timeout=300)
    manifest = out / "manifest.json"
    # torch 2.13 + gloo may abort a rank at teardown after the capture is whole (tests/test_capture.py)
    assert p.returncode == 0 or ("terminate called without an active exception" in p.stderr and manifest.is_file()
                                 and json.loads(manifest.read_text()).get("complete") is True), p.stderr[-3000:]


@pytest.fixture(scope="module")
def caps(tmp_path_factory):
    base = tmp_path_factory.mktemp("caphook")
    _capture(1, base / "tp1", "before")
    _capture(2, base / "tp2", "before")
    _capture(2, base / "tp2-after", "after")
    return base


def test_the_hook_a_users_plan_dropped_is_named(caps):
    assert json.loads((caps / "tp1" / "world.json").read_text())["param_hooks"] == {"down.weight": ["halve"]}
    p = run_cli("diff", str(caps / "tp1"), str(caps / "tp2"), "--out", str(caps / "d"))
    assert p.returncode == 0, p.stderr[-3000:]
    e = json.loads((caps / "d" / "summary.json").read_text())["degrees"]["2"]
    assert e["hooks_dropped"] == {"down.weight": ["halve"]}, e.get("hooks_dropped")
    f = e["findings"][0]
    assert (f["module"], f["kind"], f["name"], f["cause"]) == ("down", "param_grad", "weight", "sharding-bug"), f
    assert "the grad hook halve registered on down.weight before the plan" in p.stdout, p.stdout[-2000:]


def test_the_hook_registered_after_the_plan_is_kept(caps):
    p = run_cli("diff", str(caps / "tp1"), str(caps / "tp2-after"), "--out", str(caps / "d2"))
    assert p.returncode == 0, p.stderr[-3000:]
    s = json.loads((caps / "d2" / "summary.json").read_text())
    assert s["class"] == "rounding" and "hooks_dropped" not in s["degrees"]["2"], s["degrees"]["2"]


def test_only_a_dtensor_here_that_is_plain_at_the_reference_counts():
    from tpdiag.diff.dropped_hooks import captured_lost

    ref = {"param_hooks": {"a.weight": ["halve", "log"], "b.weight": ["clip"]}, "dtensor_params": []}
    assert captured_lost(ref, {"param_hooks": {"a.weight": ["log"]}, "dtensor_params": ["a.weight", "b.weight"]}) \
        == {"a.weight": ["halve"], "b.weight": ["clip"]}
    assert captured_lost(ref, {"param_hooks": {}, "dtensor_params": []}) == {}  # plain here: the user's to say
    assert captured_lost({**ref, "dtensor_params": ["a.weight", "b.weight"]},
                         {"param_hooks": {}, "dtensor_params": ["a.weight", "b.weight"]}) == {}
    assert captured_lost({}, {"param_hooks": {}, "dtensor_params": ["a.weight"]}) == {}  # an older capture
