"""`compare --format json` carries the text's `what to do:` line (a new user's script read the
verdict as JSON and found the status and class but not the advice, which rollout's JSON has)."""
import json


def test_the_json_says_what_to_do_as_the_text_does(tp12_run, capsys):
    from tpdiag.cli.advice import what_to_do
    from tpdiag.cli.common import emit_summary
    from tpdiag.records.rundir import read_summary

    s = read_summary(str(tp12_run))
    emit_summary(s, "json")
    got = json.loads(capsys.readouterr().out)
    assert got["what_to_do"] == what_to_do(s) and got["what_to_do"].startswith("nothing is wrong"), got
    emit_summary(s, "text")
    text = capsys.readouterr().out
    assert f"what to do: {got['what_to_do']}" in " ".join(text.split()), text
    # a bitwise run has no advice, and no key
    emit_summary(dict(s, status="bitwise", **{"class": None}), "json")
    assert "what_to_do" not in json.loads(capsys.readouterr().out)


def test_the_verdict_file_is_unchanged(tp12_run):
    # the key is the printed JSON's, not summary.json's (the run directory's contract)
    assert "what_to_do" not in json.loads((tp12_run / "summary.json").read_text())
