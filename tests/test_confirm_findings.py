"""A bug that only the confirmation rerun found (runner/confirm.py files it as "confirmation (FIX)")
carries that rerun's numbers, measured under the fixes. The gate checked them against the first
pass's diff.csv: a sliding window off by one in decode (tests/models/planted/rl_axes.py `window`),
one float32 ulp apart there, read "edited after the run" - exit 2 for an untouched run whose
verdict is a BUG (exit 4). They are checked against the confirmation's own diff.csv now; an edit
of one is still exit 2."""
import csv
import json
import shutil

import pytest

from conftest import run_cli

# one sequence: each decode step's GEMMs are one row (M = 1: BLAS's matrix-vector case, its own
# kernel and summation order), the prompt's four and the reference's eight rows the GEMM kernel's:
# decode's wq differs from prefill's by rounding (`batch-variant-kernel`, confirmed under the
# batch-invariant fixes) and the window's BUG behind it is the confirmation rerun's own. At two
# sequences (M = 2) that was the host's BLAS's choice: on AMD EPYC hosts wq differed; on an Intel
# Xeon (AVX-512, AMX) decode's wq/wk/wv were bitwise, the first pass found the BUG itself, no
# confirmation ran and `found` was empty. (There, a contiguous 1x32 row @ 32x32 differs from the same
# row inside M = 16 in 203 of 256 elements over 8 positions; two contiguous rows in none.)
ARGS = ("--model", "py:tests/models/planted/rl_axes.py:window", "--tp", "1", "--mode", "prefill,decode",
        "--batch-size", "1", "--seq-len", "8", "--forward-only", "--no-baseline")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("confirm_found") / "r"
    p = run_cli("compare", *ARGS, "--out", str(d))
    assert p.returncode == 0, p.stderr[-3000:]
    return d


def _found(d):
    s = json.loads((d / "summary.json").read_text())
    e = s["configurations"]["1-decode"]
    return s, [f for f in e["findings"] if str(f.get("from", "")).startswith("confirmation (")]


def test_the_confirmations_finding_carries_its_own_numbers_and_the_gate_reads_a_bug(run):
    s, found = _found(run)
    assert found, "the confirmation rerun found no bug of its own here: the case no longer tests this"
    f = found[0]
    fix = f["from"][len("confirmation ("):-1]
    rows = {r["key"]: r for r in csv.DictReader(open(run / "confirm" / fix / "diff.csv")) if r["degree"] == "1-decode"}
    assert float(rows[f["key"]]["max_abs"]) == f["max_abs"], (rows[f["key"]]["max_abs"], f["max_abs"])
    g = run_cli("gate", str(run), "--allow", "rounding")
    assert g.returncode == 4, g.stdout[-2000:]
    # compare says this finding is the confirmation rerun's; the gate's line for it said nothing of
    # it, naming another record than compare's BUG as if this run's (hnew17)
    assert f"found in the confirmation rerun ({fix})" in g.stdout, g.stdout[-2000:]


def test_an_edited_confirmation_finding_is_inconclusive(run, tmp_path):
    d = tmp_path / "edited"
    shutil.copytree(run, d)
    s, found = _found(d)
    for f in s["configurations"]["1-decode"]["findings"]:
        if f is not None and str(f.get("from", "")).startswith("confirmation ("):
            f["max_abs"] = f["max_abs"] / 2
    (d / "summary.json").write_text(json.dumps(s))
    g = run_cli("gate", str(d), "--allow", "rounding")
    assert g.returncode == 2 and "confirmation" in g.stdout.splitlines()[0], g.stdout[-2000:]


def test_a_repeated_degree_is_read_under_the_reruns_own_label():
    # `--tp 1,2,2`: the second TP=2 is "2-2" in the run and plain "2" in the confirmation rerun,
    # which confirms it alone; its finding is read under the rerun's label (confirm_label). Read
    # under "2-2" it was "not a record of that confirmation's diff.csv" - exit 2, untouched run
    from tpdiag.records.numbers import confirmation_problems

    f = {"key": "s0/forward/m/out#0/0", "from": "confirmation (fx)", "max_abs": 0.5, "bound": 1e-6}
    rows = [{"degree": "2", "key": f["key"], "max_abs": 0.5, "bound": 1e-6}]
    assert confirmation_problems({"2-2": {"findings": [{**f, "confirm_label": "2"}]}}, lambda fix: rows) == []
    assert confirmation_problems({"2-2": {"findings": [f]}}, lambda fix: rows)  # no label: not found
    edited = {**f, "confirm_label": "2", "max_abs": 0.25}
    assert "edited after the run" in confirmation_problems({"2-2": {"findings": [edited]}}, lambda fix: rows)[0]


def test_the_output_says_which_finding_is_the_confirmations(run):
    # the same record found in the first pass and again in the confirmation rerun (other numbers,
    # under the fix) printed as two identical-looking `finding` lines (an Apertus checkpoint at TP=2:
    # alpha_n 1.25e-02 and 6.16e-03 between ranks); the confirmation's now says it is
    from tpdiag.cli.common import emit_summary
    from tpdiag.records.rundir import read_summary

    s, found = _found(run)
    fix = found[0]["from"][len("confirmation ("):-1]
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        emit_summary(read_summary(str(run)), "text")
    lines = [x for x in out.getvalue().splitlines() if x.startswith("finding") and found[0]["module"] in x]
    assert any(x.endswith(f"- in the confirmation rerun (under {fix})") for x in lines), out.getvalue()
