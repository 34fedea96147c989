"""Fail closed, round 6 (red team hred9): the second pass's record files and folder, manifest.json's
status, and summary.json's account of what ran (the backward, each configuration's axes).

The second pass (RUN/ops/) is where the float64 verdicts and the findings only it makes come from, but
only its JSON files were checked: its worlds' events.jsonl and records.safetensors were never opened.
A tensor file truncated by a crashed copy, or another world's records in place of its own (ops/tp1's
copied over ops/tp2's, a tensor file symlinked to another world's), passed `gate --allow rounding`
(exit 0) and the report rendered the run as judged. Now each second-pass world's record index is read
and every stored record's dtype and shape checked against the file's header (no tensor bytes read):
inconclusive, exit 2.

manifest.json's `status` (compare's last write, the summary's status told again) edited to another
verdict than summary.json's also passed (exit 0) and reported cleanly: now the evidence disagrees.

The second pass's folder was never tied to its run: another compare's ops/ (another model size, step
count or configuration) copied over this run's passed with that run's float64 verdicts read as this
run's. Now its manifest must have been written into this run's folder, with this run's settings,
started after it.

Edits are made to copies of conftest's session runs tp12_run (tiny-llama at TP=1,2, with its ops/
pass), stock_run (TP=1,2,4,8: another compare's ops/) and mb41_stock_run (micro-batch 4 vs 1).
"""
import json
import os
import shutil

import pytest
from typer.testing import CliRunner

from tpdiag.errors import Inconclusive
from tpdiag.gate import evaluate, load_policy, with_allowed


def _cli(*args):
    from tpdiag.cli import app

    from conftest import on_cpu  # compare on the CPU unless a test names a device

    return CliRunner().invoke(app, on_cpu(args))


def _rounding():
    return with_allowed(load_policy(None), "rounding")


@pytest.fixture()
def tp12(tp12_run, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(tp12_run, dst, symlinks=True)
    assert (dst / "ops" / "tp2" / "records.safetensors").is_file()  # the run has a second pass to edit
    return dst


def _truncated(r):
    p = r / "ops" / "tp2" / "records.safetensors"
    os.truncate(p, os.path.getsize(p) // 2)


def _records_of(src):
    def edit(r):
        for name in ("events.jsonl", "records.safetensors"):
            shutil.copy(r / "ops" / src / name, r / "ops" / "tp2" / name)
    return edit


def _tensors_linked_to(src):
    def edit(r):
        p = r / "ops" / "tp2" / "records.safetensors"
        p.unlink()
        p.symlink_to(os.path.relpath(r / "ops" / src / "records.safetensors", p.parent))  # inside the pass: allowed
    return edit


def _flip_a_value(r, name="records.safetensors"):
    """One bit of one stored value flipped inside ops/tp2's tensor file, its header untouched: the dtype
    and shape of every record still agree with the index, only the record's stored hash tells."""
    import struct

    p = r / "ops" / "tp2" / name
    b = bytearray(p.read_bytes())
    n = struct.unpack("<Q", b[:8])[0]
    header = json.loads(b[8:8 + n])
    start, end = max((v["data_offsets"] for k, v in header.items() if k != "__metadata__"),
                     key=lambda o: o[1] - o[0])  # the largest tensor: a float record
    b[8 + n + (start + end) // 2 // 4 * 4] ^= 1
    p.write_bytes(bytes(b))


def _hash_dropped_and_a_value_flipped(r):
    p = r / "ops" / "tp2" / "events.jsonl"
    lines = [json.loads(x) for x in p.read_text().splitlines()]
    for m in lines:
        m.pop("stored_hash", None)
    p.write_text("".join(json.dumps(m) + "\n" for m in lines))
    _flip_a_value(r)


def _manifest_status(r):
    p = r / "manifest.json"
    d = json.loads(p.read_text())
    assert d["status"] == "divergent"
    d["status"] = "bitwise"
    p.write_text(json.dumps(d))


EDITS = {
    "ops/tp2 tensors truncated": (_truncated, "truncated"),
    "ops/tp2 records are ops/tp1's": (_records_of("tp1"), "world 1 but world.json says degree 2"),
    # (tp1's file holds tensors tp2's index never names: refused before any record's header is read)
    "ops/tp2 tensors linked to ops/tp1's": (_tensors_linked_to("tp1"), "that no record in events.jsonl names"),
    # hred10: the second pass's tensor bytes were never read by the gate (its diff.csv is trusted): a value
    # edited inside the file, its header intact, passed `gate --allow rounding` (exit 0) on b953259
    "ops/tp2 a value edited": (_flip_a_value, "does not match its hash"),
    "ops/tp2 hashes dropped, a value edited": (_hash_dropped_and_a_value_flipped, "has no stored hash"),
    "manifest status bitwise": (_manifest_status, "manifest.json says the run is 'bitwise' but summary.json says"),
}


def test_the_untouched_copy_passes_allowing_rounding(tp12):
    res = evaluate(str(tp12), _rounding())
    assert res.exit_code == 0, res.lines()  # the control: each edit below starts from a pass


@pytest.mark.parametrize("case", list(EDITS))
def test_an_edit_is_inconclusive_for_gate_and_load(tp12, case):
    import tpdiag

    edit, words = EDITS[case]
    edit(tp12)
    res = evaluate(str(tp12), _rounding())
    assert res.exit_code == 2 and res.status == "inconclusive", (case, res.lines())
    assert any(words in p for p in res.problems), (case, res.problems)
    with pytest.raises(Inconclusive, match="evidence disagrees"):
        tpdiag.load(str(tp12))


def test_the_report_and_gate_json_say_so(tp12, tmp_path):
    _records_of("tp1")(tp12)
    r = _cli("report", tp12, "-o", tmp_path / "r.html")
    assert r.exit_code == 2 and "evidence disagrees" in r.output and "Traceback" not in r.output, r.output
    top = (tmp_path / "r.html").read_text()
    top = top[:top.index('id="verdict"') + 400]
    assert 'badge inconclusive">inconclusive' in top and "the second pass in ops/" in top, top[-600:]
    r = _cli("gate", tp12, "--allow", "rounding", "--format", "json")
    assert r.exit_code == 2, r.output
    d = json.loads(r.output)
    assert d["status"] == "inconclusive" and any("the second pass in ops/" in p for p in d["problems"]), d


# -- the second pass of another run ---------------------------------------------------------------
def test_another_compare_s_second_pass_is_inconclusive(tp12, stock_run):
    assert (stock_run / "ops" / "summary.json").is_file()
    shutil.rmtree(tp12 / "ops")
    shutil.copytree(stock_run / "ops", tp12 / "ops", symlinks=True)
    res = evaluate(str(tp12), _rounding())
    assert res.exit_code == 2 and res.status == "inconclusive", res.lines()
    assert any("the second pass in ops/: ops/manifest.json was written into" in p for p in res.problems), res.problems


def _ops_manifest(fn):
    def edit(r):
        p = r / "ops" / "manifest.json"
        d = json.loads(p.read_text())
        fn(d)
        p.write_text(json.dumps(d))
    return edit


PASS_EDITS = {
    # written into this run's folder (its out as this run's), but another run's settings
    "another step count": (_ops_manifest(lambda d: d["config"].update(steps=2)), "ran steps 2 but manifest.json says 1"),
    "another seed": (_ops_manifest(lambda d: d["config"].update(seed=7)), "ran seed 7"),
    "started before the run": (_ops_manifest(lambda d: d.update(started="2001-01-01T00:00:00+0000")),
                               "before this run did"),
    "no config": (_ops_manifest(lambda d: d.pop("config")), "has no config"),
}


@pytest.mark.parametrize("case", list(PASS_EDITS))
def test_a_second_pass_not_of_this_run_is_inconclusive(tp12, case):
    edit, words = PASS_EDITS[case]
    edit(tp12)
    res = evaluate(str(tp12), _rounding())
    assert res.exit_code == 2 and res.status == "inconclusive", (case, res.lines())
    assert any(words in p for p in res.problems), (case, res.problems)


def test_a_run_directory_moved_whole_still_passes(tp12, tmp_path):
    """The control for the above: the paths are compared as the run wrote them, so a run directory
    moved (or copied) whole - to a name with spaces, quotes and non-ASCII letters - still passes."""
    moved = tmp_path / "moved \u00fc 'x' $HOME"
    shutil.move(str(tp12), str(moved))
    res = evaluate(str(moved), _rounding())
    assert res.exit_code == 0, res.lines()


# -- what ran: a configuration's axes, the backward ---------------------------------------------
# summary.json's `backward` and each configuration's `config`/`axis` (and manifest.json's
# `configurations`) were read, never checked: a micro-batch or decode configuration relabelled as
# another, or a run that ran backward said forward-only, passed (exit 0) describing another comparison.
@pytest.fixture()
def mb41(mb41_stock_run, tmp_path):
    dst = tmp_path / "mb41"
    shutil.copytree(mb41_stock_run, dst, symlinks=True)
    return dst


def _other(run):
    s = json.loads((run / "summary.json").read_text())
    return next(lab for lab in s["configurations"] if lab != s["reference_label"])


def _relabel(where):
    def edit(r):
        lab = _other(r)
        if where in ("summary", "both"):
            p = r / "summary.json"
            d = json.loads(p.read_text())
            assert d["configurations"][lab]["config"]["micro_batch"] == 1
            d["configurations"][lab]["config"]["micro_batch"] = 4
            p.write_text(json.dumps(d))
        if where in ("manifest", "both"):
            p = r / "manifest.json"
            d = json.loads(p.read_text())
            d["configurations"][lab]["micro_batch"] = 4
            p.write_text(json.dumps(d))
    return edit


def test_the_untouched_micro_batch_run_passes_allowing_rounding(mb41):
    res = evaluate(str(mb41), _rounding())
    assert res.exit_code == 0, res.lines()


@pytest.mark.parametrize("where,words", [("summary", "but manifest.json says"), ("manifest", "but manifest.json says"),
                                         ("both", "but its config runs")])
def test_a_configuration_relabelled_is_inconclusive(mb41, where, words):
    _relabel(where)(mb41)
    res = evaluate(str(mb41), _rounding())
    assert res.exit_code == 2 and res.status == "inconclusive", (where, res.lines())
    assert any(words in p and _other(mb41) in p for p in res.problems), (where, res.problems)


def test_backward_said_not_run_is_inconclusive(tp12):
    p = tp12 / "summary.json"
    d = json.loads(p.read_text())
    assert d["backward"] is True
    d["backward"] = False
    p.write_text(json.dumps(d))
    res = evaluate(str(tp12), _rounding())
    assert res.exit_code == 2 and any("summary.json says backward False" in q for q in res.problems), res.lines()


# -- the account of the flags and the verdict's class -------------------------------------------
# summary.json's `flags` (the numerics flags, an axis of their own) and `class` (the headline: bug /
# rounding / ...) were shown as written: edited to another setting, or the class to None, the gate passed
# (exit 0) and the report printed the edit.
def _summary(fn):
    def edit(r):
        p = r / "summary.json"
        d = json.loads(p.read_text())
        fn(d)
        p.write_text(json.dumps(d))
    return edit


ACCOUNT_EDITS = {
    "flags setting": (_summary(lambda d: d["flags"].update(setting="default")),
                      "summary.json says the flags 'default' ran but manifest.json says 'deterministic'"),
    "flag values": (_summary(lambda d: d["flags"]["values"].update(matmul_tf32=True)),
                    "summary.json's flag values are not the ones"),
    "class of TP=2": (_summary(lambda d: d["degrees"]["2"].update({"class": None})),
                      "summary.json says TP=2 is class None but its causes give 'rounding'"),
    "class of the run": (_summary(lambda d: d.update({"class": "harmless"})),
                         "summary.json says the run is class 'harmless' but its causes give 'rounding'"),
}


@pytest.mark.parametrize("case", list(ACCOUNT_EDITS))
def test_an_edited_account_is_inconclusive_for_gate_and_load(tp12, case):
    import tpdiag

    edit, words = ACCOUNT_EDITS[case]
    edit(tp12)
    res = evaluate(str(tp12), _rounding())
    assert res.exit_code == 2 and any(words in p for p in res.problems), (case, res.lines())
    with pytest.raises(Inconclusive, match="evidence disagrees"):
        tpdiag.load(str(tp12))
