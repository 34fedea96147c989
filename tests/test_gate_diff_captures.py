"""A `tpdiag diff` directory's captures are read again by the gate (red team hred22). `tpdiag diff` reads a
side only where its manifest.json says a complete capture (diff/runs.read_capture); the gate re-diffed the
records but never asked the manifests again, so after the diff a capture's manifest edited to
`complete: false`, to another degree, or removed (a capture its job never finished: the manifest is written
last) passed `tpdiag gate DIFF_DIR`, exit 0 on main (d1795347). Each is inconclusive now (exit 2); the
unedited diff passes (the control). Two in-process TP=1 captures of test_faults_more's plain target."""
import json
import os

from test_faults_more import make_capture, write_targets


def test_gate_asks_the_captures_of_a_diff_again(tmp_path):
    from tpdiag.diff.runs import diff_runs
    from tpdiag.gate import evaluate

    targets = write_targets(tmp_path)
    make_capture(tmp_path / "A", targets)
    make_capture(tmp_path / "B", targets)
    diff_runs(str(tmp_path / "A"), str(tmp_path / "B"), str(tmp_path / "AB"))
    r = evaluate(str(tmp_path / "AB"))
    assert r.exit_code == 0, r.problems  # the control: two complete captures of one step, bitwise
    path = tmp_path / "B" / "manifest.json"
    whole = path.read_text()
    for edit, words in ((lambda m: m.update(complete=False), "not a complete tpdiag.capture manifest"),
                        (lambda m: m.update(degree=2), "is a capture of degree 2 but"),
                        (None, "a capture without manifest.json")):
        if edit is None:
            os.remove(path)
        else:
            m = json.loads(whole)
            edit(m)
            path.write_text(json.dumps(m))
        r = evaluate(str(tmp_path / "AB"))
        assert r.exit_code == 2 and any(words in p for p in r.problems), (words, r.problems)
        path.write_text(whole)
    assert evaluate(str(tmp_path / "AB")).exit_code == 0  # restored: passes again
