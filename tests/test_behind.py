"""Mistakes BEHIND an earlier harmless reordering, each judged on its own inputs (issue 57).

tests/models/planted/behind.py, a user's hand-written TP (plain torch.distributed) at TP=1,2 in
float32 and bf16: a correct row-parallel MLP's all-reduce is the first divergence (rounding) and
every later record differs by it; behind it a "copy to the TP region" that averages the k/v
weight grads (forward exact), a sequence-parallel norm whose weight grad is never all-reduced,
and a loss scaled by the degree. Each is a BUG at its own record; the correct twin reads
`rounding only`; the gate exits 4 on each mistake, 1 on the twin and 0 on it with
`--allow rounding`.
"""
import json
import re

import pytest

from conftest import run_cli
from tpdiag.records.causes import cause_class

SPEC = "py:tests/models/planted/behind.py:"
DTYPES = ("float32", "bfloat16")
CASES = ("bugs", "loss_scaled", "good")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, behind_bugs_run):
    # float32 `bugs`: conftest's session run of this same compare (test_tamper_findings edits copies)
    out = {("bugs", "float32"): (behind_bugs_run, json.loads((behind_bugs_run / "summary.json").read_text()))}
    for dtype in DTYPES:
        for case in CASES:
            if (case, dtype) in out:
                continue
            d = tmp_path_factory.mktemp(f"{case}-{dtype}") / "r"
            p = run_cli("compare", "--model", SPEC + case, "--tp", "1,2", "--dtype", dtype, "--no-confirm",
                        "--no-baseline", "--format", "json", "--out", str(d), env={"OMP_NUM_THREADS": "1"})
            assert p.returncode == 0, p.stderr[-3000:] + p.stdout[-2000:]
            out[case, dtype] = (d, json.loads(p.stdout))
    return out


def roots(entry) -> dict:
    """(phase, module, kind, name) -> cause of every bug-class root finding."""
    return {(f["phase"], f["module"], f["kind"], f["name"]): f["cause"] for f in entry["findings"]
            if "follows" not in f and cause_class(f["cause"]) == "bug"}


def gate(run_dir, *args):
    return run_cli("gate", str(run_dir), *args)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_weight_grad_averaged_behind_a_reordering_is_a_bug_at_its_module(runs, dtype):
    _, s = runs["bugs", dtype]
    d = s["degrees"]["2"]
    fd = d["first_divergence"]
    # the first divergence is the correct MLP's reduction: rounding, not what the verdict is about
    assert fd["module"] == "mlp" and cause_class(fd["cause"]) == "rounding", fd
    found = roots(d)
    kv = {f["name"]: f for f in d["findings"] if (f["module"], f["kind"]) == ("kv", "param_grad")}
    assert sorted(kv) == ["wk", "wv"] and all(f["cause"] == "sharding-bug" for f in kv.values()), kv
    # one root per module: the backward reaches wv first, wk is grouped under it
    assert found.get(("backward", "kv", "param_grad", "wv")) == "sharding-bug", found
    assert kv["wk"]["follows"] == kv["wv"]["key"], kv
    for f in kv.values():
        # judged from this side's own inputs and grad_out: TP=2 is 1/2 of what they give
        assert f["oracle"]["own"] and f["oracle"]["far"] and abs(f["oracle"]["err"] - 0.5) < 0.02, f
    # the sequence-parallel norm's unreduced weight grad, at its own module
    assert found.get(("backward", "norm", "param_grad", "weight")) == "rank-inconsistent-replica", found
    assert d["class"] == "bug" and s["class"] == "bug"


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_loss_scaled_by_the_degree_is_a_bug_of_the_loss(runs, dtype):
    _, s = runs["loss_scaled", dtype]
    d = s["degrees"]["2"]
    found = roots(d)
    assert found == {("loss", "model", "loss", "loss"): "sharding-bug"}, d["findings"]
    assert d["class"] == "bug"


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_correct_twin_is_rounding_only_judged_on_its_own_inputs(runs, dtype):
    run_dir, s = runs["good", dtype]
    d = s["degrees"]["2"]
    assert d["class"] == "rounding" and s["class"] == "rounding", d
    assert roots(d) == {}, d["findings"]
    # the own-input re-execution ran (the second pass judged the later modules) and found them near
    assert "kv" in d.get("own_inputs", []) and "kv" in s["second_pass"]["oracle"], d


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_gate_exit_codes(runs, dtype):
    for case in ("bugs", "loss_scaled"):
        run_dir, _ = runs[case, dtype]
        for extra in ((), ("--allow", "rounding")):
            p = gate(run_dir, *extra)
            assert p.returncode == 4, (case, extra, p.stdout)
            head = p.stdout.splitlines()[0]
            # the headline names the bug, not the harmless reduction before it
            assert "a BUG beyond policy" in head and "mlp" not in head, head
    p = gate(runs["bugs", dtype][0])
    # the first bug in record order (the backward reaches the norm first), the other listed below
    assert "module norm, phase backward, record param_grad weight" in p.stdout.splitlines()[0], p.stdout
    # what follows from it is grouped under it: 8 records (the grad norm and every update after
    # the clip) until the step's own norm took a plain grad that differs between the ranks for a
    # rank's shard (runner/losses.shard_norms: Megatron-style layers) - the ranks then clip alike,
    # and only the norm weight's own update follows
    assert re.search(r"and [1-9]\d* records? that follows? from it", p.stdout.splitlines()[0]), p.stdout
    assert "module kv, phase backward, record param_grad wv, cause sharding-bug" in p.stdout, p.stdout
    assert "record param_grad wk" not in p.stdout, p.stdout  # grouped under wv's
    p = gate(runs["loss_scaled", dtype][0])
    assert "the loss function, phase loss" in p.stdout.splitlines()[0], p.stdout
    twin = runs["good", dtype][0]
    assert gate(twin).returncode == 1
    p = gate(twin, "--allow", "rounding")
    assert p.returncode == 0, p.stdout


def test_without_the_own_input_verdict_the_averaged_grad_reads_as_rounding(runs, monkeypatch):
    """Negative control: the second pass's records judged again in process, once as shipped and
    once without the own-input float64 verdict (diff/oracle_own.apply_own): only the first finds kv."""
    import os

    from tpdiag.diff import oracle_own
    from tpdiag.diff.analyse import analyse_degree
    from tpdiag.records.store import RecordSet

    run_dir, s = runs["bugs", "float32"]
    sub = s["second_pass"]["dir"]
    assert os.path.isdir(sub), s["second_pass"]

    def kv_bugs():
        entry, _ = analyse_degree(RecordSet(os.path.join(sub, "tp1")), RecordSet(os.path.join(sub, "tp2")), "2")
        return [f for f in entry["findings"] if (f["module"], f["kind"]) == ("kv", "param_grad")
                and cause_class(f["cause"]) == "bug"]

    assert kv_bugs()
    monkeypatch.setattr(oracle_own, "apply_own", lambda dd: None)
    assert kv_bugs() == []


def test_the_gate_judges_every_round_of_a_fix_chain(runs, tmp_path):
    """A bug that only a later round of `--fix auto` finds fails the gate (exit 4, naming the
    round): real runs laid out as compare lays out a chain - the correct twin as round 0 (rounding
    only), the mistakes' run as round 1 (auto/round1) - and summary.json's fix_chain naming it."""
    import shutil

    run_dir = tmp_path / "r"
    good, bugs = runs["good", "float32"][0], runs["bugs", "float32"][0]
    shutil.copytree(good, run_dir)
    r1 = run_dir / "auto" / "round1"
    shutil.copytree(bugs, r1)
    # negative control: round 0 alone passes with rounding allowed
    assert gate(run_dir, "--allow", "rounding").returncode == 0
    s = json.loads((run_dir / "summary.json").read_text())
    s["fix_chain"] = [{"round": 0, "fixes": [], "status": "divergent", "class": "rounding"},
                      {"round": 1, "fixes": ["tp-invariant-linear"], "status": "divergent", "class": "bug"}]
    (run_dir / "summary.json").write_text(json.dumps(s))
    # another run's folder as it is, copied in as a round, is not this run's round (records/sides.py)
    p = gate(run_dir, "--allow", "rounding")
    assert p.returncode == 2 and "another run" in p.stdout, p.stdout
    # relabelled as compare writes a round - written into auto/round1, this run's model, with the
    # round's fix, started with the run - the round's own records are judged
    top = json.loads((run_dir / "manifest.json").read_text())
    model, started = top["config"]["model"], top["started"]
    theirs = json.loads((bugs / "manifest.json").read_text())["config"]["model"]

    def relabel(x, key=None):
        if isinstance(x, dict):
            return {k: ["tp-invariant-linear"] if k == "fixes" and v == [] else relabel(v, k) for k, v in x.items()}
        if isinstance(x, list):
            return [relabel(v) for v in x]
        if key == "started":
            return started  # the fixture made the mistakes' run first: a round starts after its run
        return x.replace(str(bugs), str(r1)).replace(theirs, model) if isinstance(x, str) else x

    for f in r1.rglob("*.json"):
        d = relabel(json.loads(f.read_text()))
        if f.name == "summary.json" and "degrees" in d:
            d["fixes"] = ["tp-invariant-linear"]
        f.write_text(json.dumps(d))
    p = gate(run_dir, "--allow", "rounding")
    assert p.returncode == 4, p.stdout
    head = p.stdout.splitlines()[0]
    assert "a BUG beyond policy" in head and "TP=2 (fix chain round 1, with tp-invariant-linear)" in head, head
    assert "module norm, phase backward" in head, head
    # a round's evidence is checked as round 0's: a missing round is inconclusive, never a pass
    shutil.rmtree(run_dir / "auto" / "round1")
    p = gate(run_dir, "--allow", "rounding")
    assert p.returncode == 2 and "fix chain round 1" in p.stdout, p.stdout


@pytest.fixture(scope="module")
def hash_runs(tmp_path_factory):
    out = {}
    for case in ("bugs", "good"):
        d = tmp_path_factory.mktemp(f"hash-{case}") / "r"
        p = run_cli("compare", "--model", SPEC + case, "--tp", "1,2", "--capture", "hash", "--no-confirm",
                    "--no-baseline", "--format", "json", "--out", str(d), env={"OMP_NUM_THREADS": "1"})
        assert p.returncode == 0, p.stderr[-3000:] + p.stdout[-2000:]
        out[case] = (d, json.loads(p.stdout))
    return out


def test_after_a_hash_first_pass_each_module_is_judged_on_its_own_inputs(hash_runs, monkeypatch):
    """--capture hash: the region pass captures the divergent downstream modules whole and one more
    pass judges them on their own inputs - the averaged k/v grad is a BUG as in a full-capture run,
    its twin rounding only."""
    import os

    from tpdiag.diff import oracle_own
    from tpdiag.diff.analyse import analyse_degree
    from tpdiag.records.store import RecordSet

    run_dir, s = hash_runs["bugs"]
    d = s["degrees"]["2"]
    assert s["capture"] == "hash" and "kv" in d["own_inputs_hash"], d.get("own_inputs_hash")
    kv = {f["name"]: f for f in d["findings"] if (f["module"], f["kind"]) == ("kv", "param_grad")}
    assert kv["wv"]["cause"] == "sharding-bug" and kv["wv"]["oracle"]["own"], kv
    assert roots(d).get(("backward", "kv", "param_grad", "wv")) == "sharding-bug", d["findings"]
    assert d["class"] == "bug"
    p = gate(run_dir, "--allow", "rounding")
    assert p.returncode == 4 and "module kv, phase backward, record param_grad wv" in p.stdout, p.stdout
    twin_dir, t = hash_runs["good"]
    assert t["class"] == "rounding" and roots(t["degrees"]["2"]) == {}, t["degrees"]["2"]["findings"]
    assert (twin_dir / "region" / "ops" / "diff.csv").exists()  # the own-input pass ran for the twin too
    # negative control: the own-input pass's records judged without the own-input verdict
    sub = os.path.join(run_dir, "region", "ops")

    def kv_bugs():
        entry, _ = analyse_degree(RecordSet(os.path.join(sub, "tp1")), RecordSet(os.path.join(sub, "tp2")), "2")
        return [f for f in entry["findings"] if (f["module"], f["kind"]) == ("kv", "param_grad")
                and cause_class(f["cause"]) == "bug"]

    assert kv_bugs()
    monkeypatch.setattr(oracle_own, "apply_own", lambda dd: None)
    assert kv_bugs() == []
