"""A bug captured with `tpdiag.capture` in the user's own loop is named as compare names it.

Planted tests/models/planted/qk_norm_capture.py (red team hred15, case 1): a QK-norm over each
rank's local columns, inline in the attention's forward. `tpdiag compare` reads it `sharding-bug`
(its second pass re-executes the attention in float64); the capture re-executed nothing, read
"not judged (cause unknown)" and `tpdiag gate` exited 1. With `capture(oracle=["attention"])` the
reference capture holds that float64 re-execution and the diff reads BUG, gate 4; without it the
gate fails closed, exit 2, naming the call to make. The per-head norm (the correct twin) stays
rounding only with the oracle on at both degrees."""
import json
import os

import pytest

from conftest import ROOT, run_cli, run_module

SCRIPT = os.path.join(ROOT, "tests", "models", "planted", "qk_norm_capture.py")


def _torchrun(nproc: int, out) -> None:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = run_module("torch.distributed.run", "--standalone", "--nproc-per-node",
                   str(nproc), SCRIPT, str(out), "--all", env=env,
                   cwd=ROOT, timeout=300)
    done = all(json.loads((out / sub / "manifest.json").read_text()).get("complete") is True
               for sub in ("bug", "bug-oracle", "ok-oracle") if (out / sub / "manifest.json").is_file())
    # torch + gloo may abort a rank at interpreter teardown after the captures are on disk (test_capture.py)
    assert p.returncode == 0 or ("terminate called without an active exception" in p.stderr and done), \
        p.stdout[-3000:] + p.stderr[-3000:]


@pytest.fixture(scope="module")
def caps(tmp_path_factory):
    base = tmp_path_factory.mktemp("qkcap")
    _torchrun(1, base / "tp1")
    _torchrun(2, base / "tp2")
    return base


def _diff_gate(caps, tmp_path, ref: str, other: str, *gate_args):
    out = tmp_path / f"d-{ref}-{other}"
    p = run_cli("diff", str(caps / "tp1" / ref), str(caps / "tp2" / other), "--out", str(out))
    assert p.returncode == 0, p.stdout + p.stderr
    g = run_cli("gate", str(out), *gate_args)
    return json.loads((out / "summary.json").read_text()), p.stdout, g


def test_capture_with_oracle_names_the_bug(caps, tmp_path):
    # the compared side recorded its own float64 re-execution too (one script at both degrees): not compared
    s, text, g = _diff_gate(caps, tmp_path, "bug-oracle", "bug-oracle")
    fd = s["degrees"]["2"]["first_divergence"]
    assert s["class"] == "bug" and fd["cause"] == "sharding-bug", fd
    assert fd["key"] == "s0/forward/attention.wo/in#0/0" and fd["module"] == "attention"
    assert "unjudged_capture" not in s["degrees"]["2"]
    assert "BUG" in text.splitlines()[0]
    assert g.returncode == 4, g.stdout + g.stderr
    f = run_cli("diff", str(caps / "tp1" / "bug-oracle"), str(caps / "tp2" / "bug-oracle"), "--out",
                str(tmp_path / "f"), "--fail-on-divergence")
    assert f.returncode == 4, f.stdout + f.stderr


def test_oracle_on_the_reference_alone_is_enough(caps, tmp_path):
    s, _, g = _diff_gate(caps, tmp_path, "bug-oracle", "bug")
    assert s["class"] == "bug" and s["degrees"]["2"]["first_divergence"]["cause"] == "sharding-bug"
    assert g.returncode == 4, g.stdout + g.stderr


def test_capture_without_oracle_fails_closed_naming_the_call(caps, tmp_path):
    s, text, g = _diff_gate(caps, tmp_path, "bug", "bug")
    d = s["degrees"]["2"]
    assert s["class"] == "unknown" and d["first_divergence"]["cause"] == "unknown"
    assert d["unjudged_capture"]["module"] == "attention"
    call = "tpdiag.capture(..., oracle=['attention'])"
    assert call in d["unjudged_capture"]["why"]
    assert call in next(ln for ln in text.splitlines() if ln.startswith("what to do:"))
    # inconclusive (2), never the plain divergence exit (1) that read as "not a bug"
    assert g.returncode == 2, g.stdout + g.stderr
    assert call in g.stdout
    # `tpdiag diff --fail-on-divergence` exits as the gate does
    f = run_cli("diff", str(caps / "tp1" / "bug"), str(caps / "tp2" / "bug"), "--out", str(tmp_path / "f"),
                "--fail-on-divergence")
    assert f.returncode == 2 and call in f.stderr, f.stdout + f.stderr
    # a policy that allows `unknown` by name is the user's say: the plain policy verdict
    g = run_cli("gate", str(tmp_path / "d-bug-bug"), "--allow", "unknown")
    assert g.returncode in (0, 1), g.stdout + g.stderr


def test_correct_twin_stays_rounding_with_the_oracle_on(caps, tmp_path):
    s, _, g = _diff_gate(caps, tmp_path, "ok-oracle", "ok-oracle", "--allow", "rounding")
    assert s["class"] == "rounding", s["degrees"]["2"]["first_divergence"]
    assert g.returncode == 0, g.stdout + g.stderr
