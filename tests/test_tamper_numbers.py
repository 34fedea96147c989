"""Tamper suite, the numbers (issue 58): every number the gate and the report show is re-derived from
the records - summary.json's logprob, loss and grad norm differences, its record counts, the records
only one side holds, diff.csv's rows - and an edit to any of them, alone or together with diff.csv, is
inconclusive: the gate exits 2, and so does `tpdiag report` (one line naming the file and what
disagrees) after writing a page that says inconclusive at the top.

One real compare (conftest's shared TP=1,2 run); every case edits a copy of it. On the code before
this change (ed1fba1) the gate passed the summary-only cases and the report exited 0 on all of them.
"""
import json
import shutil

import pytest
from typer.testing import CliRunner

from tpdiag.gate import evaluate, load_policy


def _json_edit(path, fn):
    d = json.loads(path.read_text())
    fn(d)
    path.write_text(json.dumps(d))


def _tp2(fn):
    return lambda r: _json_edit(r / "summary.json", lambda d: fn(d["degrees"]["2"]))


def _csv_edit(r, fn):
    lines = (r / "diff.csv").read_text().splitlines(keepends=True)
    (r / "diff.csv").write_text("".join(fn(lines)))


def _cut_events_at_a_line(r):
    """The last record of TP=2 and its diff.csv row removed, and summary.json's counts made to agree:
    events.jsonl still parses, every record left matches - only world.json's count knows."""
    ev = (r / "tp2" / "events.jsonl").read_text().splitlines(keepends=True)
    last = json.loads(ev[-1])["key"]
    (r / "tp2" / "events.jsonl").write_text("".join(ev[:-1]))
    _csv_edit(r, lambda ls: [ln for ln in ls if f",{last}," not in ln])

    def counts(d):
        d["n_records"] -= 1
    _tp2(counts)(r)


def _clean_table(r):
    """diff.csv emptied to its header and summary.json made bitwise: a clean table over divergent records."""
    _csv_edit(r, lambda ls: ls[:1])

    def clean(d):
        d["status"] = "bitwise"
        for lab, e in d["degrees"].items():
            e.update(status="bitwise", first_divergence=None, findings=[], n_divergent=0)
    _json_edit(r / "summary.json", clean)


NUMBERS = {
    "logprob max abs 0": _tp2(lambda e: e["logprobs"].update(max_abs=0.0)),
    "logprobs called bitwise": _tp2(lambda e: e["logprobs"].update(bitwise=True)),
    "token_mult_prob_error 1": _tp2(lambda e: e["logprobs"].update(token_mult_prob_error=1.0)),
    "logprob token count": _tp2(lambda e: e["logprobs"].update(tokens=e["logprobs"]["tokens"] + 1)),
    "loss made the reference's": _tp2(lambda e: e["loss"].update(value=e["loss"]["reference"], abs_diff=0.0)),
    "loss diff only": _tp2(lambda e: e["loss"].update(abs_diff=0.0)),
    "grad norm": _tp2(lambda e: e["grad_norm"].update(value=e["grad_norm"]["reference"])),
    "divergent count 0": _tp2(lambda e: e.update(n_divergent=0)),
    "record count": _tp2(lambda e: e.update(n_records=e["n_records"] + 5)),
    "a record only at TP=2 invented": _tp2(lambda e: e.update(unmatched=["s0/forward/x/out#0/0"])),
    "diff.csv row listed twice": lambda r: _csv_edit(r, lambda ls: ls + ls[-1:]),
    "events.jsonl cut at a line boundary": _cut_events_at_a_line,
    "empty diff.csv under a clean summary": _clean_table,
}


@pytest.fixture()
def run(tp12_run, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(tp12_run, dst)
    return dst


def _permissive(run, tmp_path):
    s = json.loads((run / "summary.json").read_text())
    causes = {s["degrees"]["2"]["first_divergence"]["cause"]}
    p = tmp_path / "allow.toml"
    p.write_text("allow_causes = [%s]\n" % ", ".join(f'"{c}"' for c in sorted(causes)))
    return load_policy(str(p))


def _report(run, html):
    from tpdiag.cli import app

    return CliRunner().invoke(app, ["report", str(run), "-o", str(html)])


def test_untouched_copy_passes_and_reports_cleanly(run, tmp_path):
    """The control: the gate passes it under a policy allowing its cause, the report exits 0."""
    res = evaluate(str(run), _permissive(run, tmp_path))
    assert res.exit_code == 0, res.lines()
    r = _report(run, tmp_path / "r.html")
    assert r.exit_code == 0, r.output
    assert 'badge inconclusive">inconclusive' not in (tmp_path / "r.html").read_text()


@pytest.mark.parametrize("case", list(NUMBERS))
def test_a_tampered_number_is_inconclusive_for_gate_and_report(run, tmp_path, case):
    policy = _permissive(run, tmp_path)
    NUMBERS[case](run)
    res = evaluate(str(run), policy)
    assert res.exit_code == 2 and res.status == "inconclusive", (case, res.lines())
    html = tmp_path / "r.html"
    r = _report(run, html)
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert r.exit_code == 2 and len(lines) == 1, (case, r.output)
    assert "inconclusive" in lines[0] and str(run) in lines[0] and str(html) in lines[0], lines[0]
    assert any(f in lines[0] for f in ("summary.json", "diff.csv", "events.jsonl")), lines[0]
    top = html.read_text()
    top = top[:top.index('id="verdict"') + 600]
    assert 'badge inconclusive">inconclusive' in top and "evidence disagrees" in top, (case, top[-800:])


def test_the_line_names_the_field_and_both_values(run, tmp_path):
    NUMBERS["loss made the reference's"](run)
    s = json.loads((run / "summary.json").read_text())["degrees"]["2"]["loss"]
    r = _report(run, tmp_path / "r.html")
    assert r.exit_code == 2 and "summary.json's TP=2 loss.value is" in r.output, r.output
    assert repr(s["value"]) in r.output  # the edited value, then what the records give


def test_a_tampered_per_step_loss_is_inconclusive(tmp_path_factory, tmp_path):
    """Two optimizer steps: the report's per-step table comes from summary.json's `steps`. Step 1's
    loss edited to the reference's: on ed1fba1 the gate passed under a policy allowing its cause and the report
    exited 0 showing the edit."""
    from conftest import run_cli, shared_run

    def make(out):
        p = run_cli("compare", "--tp", "1,2", "--steps", "2", "--no-confirm", "--no-baseline", "--out", str(out))
        assert p.returncode == 0, p.stderr[-2000:]
    run = tmp_path / "run"
    shutil.copytree(shared_run(tmp_path_factory, "tp12-steps2", make), run)

    def edit(e):
        e["steps"][1]["loss"] = e["steps"][1]["loss_reference"]
    _tp2(edit)(run)
    res = evaluate(str(run), _permissive(run, tmp_path))
    assert res.exit_code == 2 and "steps[1].loss" in res.lines()[0], res.lines()
    r = _report(run, tmp_path / "r.html")
    assert r.exit_code == 2 and "steps[1].loss" in r.output, r.output
