"""The own-input pass's float64 backwards tap only the children whose output grads the diff reads
(diff/own_inputs.taps): those with a divergent grad_out that no one module consumes, read by the
code of a re-executed module (diff/enclosing.tapped). Before, every re-executed module's float64
backward tapped every child (tiny-llama at TP=2: 208 oracle records in the own-input pass's
reference, 200 with only these: its norms' output grads each have one consumer, their attention or
MLP). tests/models/planted/two_paths.py:gate_f - its root re-executed for the
block's output grad (read by the gate and by the plain multiply): embed's and norm's outputs have
one module consumer each (block, head), so their taps were recorded and never read. The A/B
(TPDIAG_OWN_TAPS=0: every child, as before) gives the same findings with more records."""
import json

import pytest

from conftest import run_cli

SPEC = "py:tests/models/planted/two_paths.py:gate_f"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for ab in ("1", "0"):
        d = tmp_path_factory.mktemp(f"taps{ab}") / "r"
        p = run_cli("compare", "--model", SPEC, "--tp", "1,2", "--no-baseline", "--no-confirm", "--out", str(d),
                    env={"OMP_NUM_THREADS": "1", "TPDIAG_OWN_TAPS": ab})
        assert p.returncode == 0, (ab, p.stderr[-3000:] + p.stdout[-2000:])
        s = json.loads((d / "summary.json").read_text())
        ref = [json.loads(line) for line in open(f"{s['second_pass']['dir']}/tp1/events.jsonl")]
        out[ab] = (s, [m["key"] for m in ref if m["kind"] == "oracle"])
    return out


def _taps(keys):
    """the modules whose output grads a float64 backward tapped (grad_out.O.cJ.pP records)"""
    return {k.split("/")[2] for k in keys if "/oracle#" in k and "/grad_out." in k and ".p" in k.rsplit("/", 1)[1]}


def test_only_the_grads_the_diff_reads_are_tapped(runs):
    (s, keys), (_, every) = runs["1"], runs["0"]
    assert _taps(every) == {"block", "embed", "gate", "gate.proj", "head", "norm"}, sorted(_taps(every))
    assert _taps(keys) == set(s["degrees"]["2"]["own_taps"]) == {"block", "gate", "gate.proj", "head"}
    assert set(keys) < set(every), sorted(set(keys) - set(every))


def test_the_verdicts_stay_the_same(runs):
    (s, _), (t, _) = runs["1"], runs["0"]
    assert s["class"] == t["class"] == "bug"
    a, b = s["degrees"]["2"], t["degrees"]["2"]

    def findings(e):
        return [(f["key"], f["cause"], f.get("follows"), (f.get("oracle") or {}).get("err")) for f in e["findings"]]

    assert findings(a) == findings(b) and findings(a), (findings(a), findings(b))
    fa, fb = ({k: e["first_divergence"].get(k) for k in ("key", "cause", "op", "oracle")} for e in (a, b))
    assert a.get("not_judged") == b.get("not_judged") and fa == fb, (fa, fb)
    f = next(f for f in a["findings"] if f["key"] == "s0/backward/block/grad_out#0/0")
    assert "enclosing module's (model)" in f["oracle"]["what"], f
