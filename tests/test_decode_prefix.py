"""Decode reruns on the first positions (runner/prefix.py), real gloo worlds, tiny shapes.

After the first pass (every position), the region pass and the confirmation of a TP=1 decode
configuration run the prompt call and the first 16 one-token calls only; the prefill reference
records the same positions of its records. Used only where that reproduces the first divergence."""

import torch
from conftest import run_cli, summary_of

from tpdiag.records.store import RecordSet

ARGS = ("--tp", "1", "--mode", "prefill,decode", "--forward-only", "--batch-size", "1",
        "--seq-len", "64", "--no-baseline", "--format", "json")
# the region pass runs on the first positions only where no downstream module is judged on its
# own inputs (those are judged on every position: runner/drill.py); the tests of that mechanism
# turn the own-input judgement off
PREFIX_ONLY = ("--no-judge-downstream",)


def _bits(t):
    return t.contiguous().view(torch.int32)


def _record(run_dir, label, key):
    rs = RecordSet(str(run_dir / f"tp{label}"))
    return rs.tensor(rs.by_key[key])


def test_region_and_confirmation_run_the_first_positions_and_equal_the_whole_run(tmp_path):
    """The default flow on the built-in model (hash first pass): the region pass and the
    confirmation see positions 0..47 of 64 (prompt 32 + 16 calls), and say so; their records are
    the whole run's first 48 positions, bit for bit, in both worlds (a full-capture run of every
    position is the check)."""
    cut, whole = tmp_path / "cut", tmp_path / "whole"
    r = run_cli("compare", *ARGS, *PREFIX_ONLY, "--capture", "hash", "--out", str(cut))
    assert r.returncode == 0, r.stderr
    d = summary_of(cut)["configurations"]["1-decode"]
    fd, conf = d["first_divergence"], d["confirmation"]
    assert fd["positions"] == [48, 64] and fd["cause"] == "batch-variant-kernel", fd
    # the values and the op came from the rerun: its reference computed pass 1's step (logits and
    # parameters' fingerprint) and its decode world checked its own probes
    assert fd.get("op") and fd.get("max_abs", 0) > 0 and not fd.get("values_detail"), fd
    assert conf["verdict"] == "confirmed" and conf["positions"] == [48, 64], conf
    assert summary_of(cut)["second_pass"]["dir"] == str(cut / "region")
    r = run_cli("compare", *ARGS, "--capture", "full", "--no-confirm", "--out", str(whole))
    assert r.returncode == 0, r.stderr
    region = cut / "region"
    key = fd["key"]  # a module output both runs recorded at every (whole) or the first 48 positions
    for label in ("1", "1-decode"):
        part, full = _record(region, label, key), _record(whole, label, key)
        assert part.shape[1] == 48 and full.shape[1] == 64, (part.shape, full.shape)
        assert torch.equal(_bits(part), _bits(full[:, :48]))
    logits = _record(region, "1-decode", "s0/loss/model/logits#0/logits")
    assert logits.shape[:2] == (1, 48)


def test_a_divergence_past_the_first_positions_reruns_every_position(tmp_path):
    """Negative control: a model whose one-token calls go wrong only from position 56 on
    (tests/models/late_decode.py), under --fix all (decode is prefill's bits before that). The
    first positions do not reproduce its first divergence, so the region pass runs every
    position again and names it there; nothing claims a prefix."""
    out = tmp_path / "late"
    r = run_cli("compare", "--model", "py:tests/models/late_decode.py:target", *ARGS, "--capture", "hash",
                "--fix", "all", "--out", str(out))
    assert r.returncode == 0, r.stderr
    s = summary_of(out)
    fd = s["configurations"]["1-decode"]["first_divergence"]
    assert fd["module"] == "late" and "positions" not in fd, fd
    # every position: at once where pass 1 named suspects, else after the first ones failed
    assert s["second_pass"]["dir"] in (str(out / "region"), str(out / "region-all"))
    assert fd.get("max_abs", 0) > 0 and not fd.get("values_detail"), fd
    assert "positions" not in (s["configurations"]["1-decode"].get("confirmation") or {})


def test_a_late_bug_beside_early_rounding_is_not_hidden_by_the_first_positions(tmp_path):
    """Stock decode differs by rounding from the first one-token call on; the same model's
    one-token calls are also wrong (x 1.5) from position 56. The first positions reproduce the
    first divergence (the rounding), and the late module's output differs there too - by
    rounding; its x 1.5 shows only later. Pass 1 names it a suspect, so the region pass runs
    every position, finds the bug there, and the verdict is BUG - not "rounding only" from
    positions 0..47 (what a rerun trusted on its first divergence alone said)."""
    out = tmp_path / "late_bug"
    r = run_cli("compare", "--model", "py:tests/models/late_decode.py:bug_target", *ARGS, "--capture", "hash",
                "--out", str(out))
    assert r.returncode == 0, r.stderr
    s = summary_of(out)
    d = s["configurations"]["1-decode"]
    assert d.get("suspects") == ["late"] and s["second_pass"]["dir"] == str(out / "region"), d.get("suspects")
    assert "positions" not in d["first_divergence"], d["first_divergence"]
    assert s["class"] == "bug", s["class"]
    assert any(f["module"] == "late" for f in d["findings"]), d["findings"]


def test_a_rerun_whose_first_positions_are_not_pass_ones_runs_every_position(tmp_path):
    """Negative control for the cross-pass check: a decode whose noise is seeded per process
    (tests/models/per_process_decode.py) passes each world's self-check, but the rerun's logits
    over the first positions are not pass 1's (the self-checks' hashes differ), so the region
    pass runs every position."""
    out = tmp_path / "pp"
    r = run_cli("compare", "--model", "py:tests/models/per_process_decode.py:target", *ARGS, *PREFIX_ONLY, "--capture", "hash",
                "--no-confirm", "--out", str(out))
    assert r.returncode == 0, r.stderr
    s = summary_of(out)
    assert (out / "region" / "summary.json").exists(), s.get("second_pass")  # tried first ...
    assert s["second_pass"]["dir"] == str(out / "region-all")  # ... and not trusted
    assert "positions" not in s["configurations"]["1-decode"]["first_divergence"]
