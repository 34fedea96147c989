"""A user's own grad-norm clipping in a `tpdiag.capture`d TP training loop
(tests/models/planted/clip_norm.py, helper hplant17): the squares of every grad all-reduced (each
replicated grad counted TP times: one norm on every rank, too large) is a `sharding-bug` at the
step's grad norm; the sharded squares never all-reduced (each rank clips by its own shards' norm)
is a `rank-inconsistent-replica` there; the twin (sharded squares all-reduced, replicated counted
once) reads rounding only. Read right when written (no tpdiag change)."""
import json
import os

import pytest

from conftest import run_cli, run_module

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "models", "planted", "clip_norm.py")


def _capture(nproc: int, out, clip: str) -> None:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    p = run_module("torch.distributed.run", "--standalone", "--nproc-per-node",
                   str(nproc), SCRIPT, "--out", str(out), "--clip", clip, env=env, cwd=ROOT, timeout=300)
    manifest = out / "manifest.json"
    # torch 2.13 + gloo may abort a rank at teardown after the capture is whole (tests/test_capture.py)
    assert p.returncode == 0 or ("terminate called without an active exception" in p.stderr and manifest.is_file()
                                 and json.loads(manifest.read_text()).get("complete") is True), p.stderr[-3000:]


@pytest.fixture(scope="module")
def diffs(tmp_path_factory):
    base = tmp_path_factory.mktemp("clip")
    _capture(1, base / "tp1", "shards")
    out = {}
    for clip in ("all", "local", "shards"):
        _capture(2, base / f"tp2-{clip}", clip)
        d = base / f"d-{clip}"
        p = run_cli("diff", str(base / "tp1"), str(base / f"tp2-{clip}"), "--out", str(d))
        assert p.returncode == 0, p.stderr[-2000:]
        out[clip] = (json.loads((d / "summary.json").read_text()), p.stdout,
                     run_cli("gate", str(d), "--allow", "rounding").returncode)
    return out


@pytest.mark.parametrize("clip,cause", [("all", "sharding-bug"), ("local", "rank-inconsistent-replica")])
def test_each_clip_mistake_is_a_bug_at_the_grad_norm(diffs, clip, cause):
    from tpdiag.diff.classes import leading_bug

    s, stdout, gate = diffs[clip]
    lead = leading_bug(s["degrees"]["2"])
    assert s["class"] == "bug" and lead is not None, s["degrees"]["2"]
    assert (lead["phase"], lead["kind"], lead["name"], lead["cause"]) == ("optimizer", "grad_norm", "total", cause), lead
    assert lead["bound_ratio"] > 100, lead
    assert "BUG (a wrong result, not rounding) at TP=2 optimizer: grad_norm total" in stdout and gate == 4, stdout


def test_the_twin_is_rounding(diffs):
    s, stdout, gate = diffs["shards"]
    assert s["class"] == "rounding" and not s["degrees"]["2"].get("findings"), s["degrees"]["2"]
    assert "BUG" not in stdout and gate == 0, stdout
