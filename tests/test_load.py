"""`tpdiag.load(run_dir)`: the run directory as DataFrames, agreeing with diff.csv and summary.json."""
import csv
import json
import math
import shutil
import subprocess
import sys

import pandas as pd
import pytest
from conftest import ROOT

import tpdiag
from tpdiag.errors import BadInput, Inconclusive


@pytest.fixture(scope="module")
def run(tp12_run):
    return tpdiag.load(str(tp12_run))


def _csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _summary(path):
    return json.loads((path / "summary.json").read_text())


def test_import_tpdiag_loads_neither_pandas_nor_torch():
    code = "import sys, tpdiag; tpdiag.load; print(sorted(m for m in ('pandas', 'torch') if m in sys.modules))"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "[]"


def test_records_are_diff_csv_row_for_row(run, tp12_run, tmp_path):
    raw = _csv(tp12_run / "diff.csv")
    df = run.records
    assert len(df) == len(raw) > 0
    for (_, r), c in zip(df.iterrows(), raw):
        assert (r["degree"], r["key"], r["phase"], r["module"], r["kind"], r["shape"]) == \
               (c["degree"], c["key"], c["phase"], c["module"], c["kind"], c["shape"])
        assert int(r["idx"]) == int(c["idx"]) and int(r["step"]) == int(c["step"])
        for k in ("bitwise", "rank_consistent", "beyond_bound"):
            assert (None if pd.isna(r[k]) else str(bool(r[k]))) == (c[k] or None)
        for k in ("max_abs", "max_rel", "mismatch_fraction", "bound"):
            if c[k] == "":
                assert math.isnan(r[k])
            else:  # the same double, not a rounded one
                assert r[k] == float(c[k])
        assert (None if c["max_ulp"] == "" else int(c["max_ulp"])) == \
               (None if pd.isna(r["max_ulp"]) else int(r["max_ulp"]))
    # diff.csv is written from this frame: writing it again gives the same bytes
    from tpdiag.records.frames import write_diff_csv

    write_diff_csv(str(tmp_path / "again.csv"), df)
    assert (tmp_path / "again.csv").read_bytes() == (tp12_run / "diff.csv").read_bytes()


def test_first_divergence_and_cause_come_from_summary(run, tp12_run):
    summary = _summary(tp12_run)
    df = run.records
    for lab, d in summary["degrees"].items():
        fd = d["first_divergence"]
        mine = df[df["degree"] == lab]
        first = mine[mine["first"]]
        assert list(first["key"]) == [fd["key"]]
        assert list(first["cause"]) == [fd["cause"]]
        assert bool(first["divergent"].iloc[0])
        # every record before the first divergence is bitwise equal
        assert not mine[mine["idx"] < fd["idx"]]["divergent"].any()
        assert int(mine["divergent"].sum()) >= d["n_divergent"] > 0
        row = run.degrees.set_index("degree").loc[lab]
        assert (row["status"], row["cause"], row["first_module"], row["n_records"], row["n_divergent"]) == \
               (d["status"], fd["cause"], fd["module"], d["n_records"], d["n_divergent"])
        assert len(run.findings[run.findings["degree"] == lab]) == len(d["findings"])


def test_steps_and_logprobs_agree_with_summary(run, tp12_run):
    summary = _summary(tp12_run)
    raw = _csv(tp12_run / "diff.csv")
    for lab, d in summary["degrees"].items():
        s = run.steps[run.steps["degree"] == lab].set_index("step").loc[0]
        assert s["loss"] == d["loss"]["value"] and s["loss_reference"] == d["loss"]["reference"]
        assert s["grad_norm"] == d["grad_norm"]["value"]
        params = [float(c["max_abs"]) for c in raw if c["degree"] == lab and c["kind"] == "param"]
        assert s["param_max_abs"] == max(params)
        assert bool(s["bitwise"]) is False  # the stock TP=2 run diverges in the forward pass
        lp = run.logprobs.set_index("degree").loc[lab]
        for k in ("bitwise", "max_abs", "mean_abs", "token_mult_prob_error", "tokens"):
            assert lp[k] == d["logprobs"][k]
    tok = run.token_logprobs()
    for lab, d in summary["degrees"].items():
        t = tok[(tok["degree"] == lab) & tok["scored"]]
        assert len(t) == d["logprobs"]["tokens"]
        assert t["abs_diff"].max() == d["logprobs"]["max_abs"]  # same float64 differences
        assert bool(t["bitwise"].all()) == d["logprobs"]["bitwise"]


def test_bad_run_dirs_are_typed_errors(tp12_run, tmp_path):
    with pytest.raises(BadInput):
        tpdiag.load(str(tmp_path / "nope"))
    dst = tmp_path / "run"
    shutil.copytree(tp12_run, dst)
    m = json.loads((dst / "manifest.json").read_text())
    del m["status"]  # what an interrupted compare leaves
    (dst / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(Inconclusive, match="incomplete run"):
        tpdiag.load(str(dst))


def test_token_logprobs_rows_are_the_batch_and_recompute_from_the_logits(run):
    """A user checking tpdiag's logprobs against their own (helper hnew17): each row is one
    (sequence, position) of the batch with the token it scores. The flat logprobs record was read
    as one sequence (a batch of 2 x 16 came back as sequence 0, positions 0..31) and no token id
    was given, so a user's own logits could not be lined up with them."""
    import torch

    from tpdiag.records.layout import assemble
    from tpdiag.records.rundir import records_dir
    from tpdiag.records.store import RecordSet

    batch = run.batch()
    ids, labels = batch["input_ids"], batch["labels"]
    tok = run.token_logprobs()
    t = tok[tok["degree"] == tok["degree"].iloc[0]]
    assert sorted(set(t["sequence"])) == list(range(ids.shape[0])), sorted(set(t["sequence"]))
    assert t["position"].max() == ids.shape[1] - 1
    assert t["token"].tolist() == labels.flatten().tolist()
    assert t["scored"].tolist() == (labels.flatten() != -100).tolist()
    # the reference's logits record, log-softmaxed in float32 and gathered at the token: the same bits
    rs = RecordSet(records_dir(run.run_dir, run.manifest, run.reference))
    e = next(e for e in rs.events if e["kind"] == "logits" and e["step"] == 0)
    logits = assemble(e, rs.tensor(e), None).full
    mine = logits.float().log_softmax(-1)[t["sequence"].tolist(), t["position"].tolist(), labels.flatten().clamp(min=0).tolist()]
    sc = torch.tensor(t["scored"].tolist())
    ref = torch.tensor(t["reference"].tolist(), dtype=torch.float64)
    assert torch.equal(mine[sc].double(), ref[sc]), (mine[sc] - ref[sc].float()).abs().max()
