"""Issue 62 item 1: one ordered cause judge (diff/judge.py). The passes give evidence; RULES,
first match wins, turns it into the cause. Adding a cause is one registry entry plus one rule:
here a toy cause added in the test is named in a real (gloo, TP=1,2) run directory's summary,
classed by the registry and failed by the gate, and the same run without the rule is not."""
import shutil

import pytest

from tpdiag.diff import judge
from tpdiag.diff.judge import Evidence, Rule, describe, settle
from tpdiag.records import causes
from tpdiag.records.causes import EXIT_BUG, Cause

TOY = Cause("toy-rowwise-bug", "bug", "the toy rule calls every row-parallel output wrong",
            short="toy-row", action="Fix the toy.")
TOY_RULE = Rule("toy: a row-parallel output",
                lambda ev, below: ev.row is not None and ev.row.get("style") == "rowwise" and ev.row["kind"] == "out",
                lambda ev, below: TOY.label, lambda ev, below: "the toy rule saw a row-parallel output")


def _at(name: str) -> int:
    return next(i for i, r in enumerate(judge.RULES) if r.name == name)


def _reanalyse(src, tmp_path):
    """The real run's records judged again, in this process (where the test's rule is)."""
    from tpdiag.diff.analyse import analyse_run
    from tpdiag.gate.verdict import evaluate
    from tpdiag.records.paths import SECOND_PASS_DIRS
    from tpdiag.records.rundir import read_summary
    from tpdiag.records.run_files import write_summary

    run = tmp_path / "run"
    shutil.copytree(src, run)
    # pass 1 judged again: the run's second pass (which this summary will not name) goes, else the
    # gate reads the directory as edited (records/integrity.py: a second pass summary.json omits)
    for name in SECOND_PASS_DIRS:
        shutil.rmtree(run / name, ignore_errors=True)
    # with the run's reference rerun, as the compare judged it (a summary that drops a baseline
    # the manifest ran reads as edited: records/integrity.py)
    base = "1-base" if (run / "tp1-base").is_dir() else None
    summary = analyse_run(str(run), "1", ["2"], {}, 1, base)  # returns it; the one writer writes it
    write_summary(str(run), summary)
    d = read_summary(str(run))["degrees"]["2"]
    return d, evaluate(str(run))


def test_a_new_cause_is_one_entry_and_one_rule(tp12_run, tmp_path, monkeypatch):
    monkeypatch.setitem(causes.REGISTRY, TOY.label, TOY)
    monkeypatch.setattr(judge, "RULES", judge.RULES[:_at("layout names the reordering")] + [TOY_RULE]
                        + judge.RULES[_at("layout names the reordering"):])
    d, gate = _reanalyse(tp12_run, tmp_path)
    fd = d["first_divergence"]
    assert fd["cause"] == TOY.label and fd["why"] == "the toy rule saw a row-parallel output", fd
    assert d["class"] == "bug"  # the registry's class
    assert gate.exit_code == EXIT_BUG and gate.first_violation.cause == TOY.label, gate.lines()


def test_negative_control_without_the_rule(tp12_run, tmp_path, monkeypatch):
    monkeypatch.setitem(causes.REGISTRY, TOY.label, TOY)
    d, gate = _reanalyse(tp12_run, tmp_path)
    assert d["first_divergence"]["cause"] == "row-parallel-reduction" and d["class"] == "rounding", d
    assert gate.exit_code != EXIT_BUG


def test_the_order_is_the_precedence(tp12_run, tmp_path, monkeypatch):
    # the same rule placed after the layout's: the layout names the record first, the toy never wins
    monkeypatch.setitem(causes.REGISTRY, TOY.label, TOY)
    at = _at("layout names the reordering") + 1
    monkeypatch.setattr(judge, "RULES", judge.RULES[:at] + [TOY_RULE] + judge.RULES[at:])
    d, _ = _reanalyse(tp12_run, tmp_path)
    assert d["first_divergence"]["cause"] == "row-parallel-reduction"


def _row(**kw):
    row = {"phase": "optimizer", "kind": "grad_norm", "style": None, "cls": None, "module": "model",
           "name": "total", "step": 0, "key": "s0/optimizer/model/grad_norm#0/total", "bitwise": False,
           "beyond_bound": True, "bound": 1e-9}
    row.update(kw)
    return row


def test_evidence_from_several_passes_is_judged_in_rule_order():
    # a grad norm beyond its bound (a bug by its row), between two TP=1 worlds (the TP=1 rule
    # clears it), of a micro-batch configuration (the axis rule names it): each overridden
    # cause is kept where the summary has always kept it
    row = _row()
    f = describe(row, {"kind": "grad_norm", "bound": 1e-9, "cause": None})
    assert f["cause"] == "sharding-bug" and "why" not in f
    v = settle(f, tp1_both=True)
    assert (f["cause"], f["cause_before"], v.rule) == ("grad-norm", "sharding-bug", "grad norm beyond its bound at TP=1")
    settle(f, axis="micro_batch")
    assert f["cause"] == "batch-variant-kernel" and f["layout_cause"] == "grad-norm" and f["cause_before"] == "sharding-bug"
    assert f["why"] == judge.WHY_AXIS["grad_norm"]
    # a float64 verdict that found it wrong stays a bug through both: no rule below clears it
    g = describe(row, {"kind": "grad_norm", "bound": 1e-9, "cause": None, "oracle": {"far": True}})
    settle(g, tp1_both=True)
    settle(g, axis="micro_batch")
    assert g["cause"] == "sharding-bug" and "layout_cause" not in g and "cause_before" not in g


def test_noise_and_non_finite():
    row = _row(nonfinite_mismatch=True)
    f = describe(row, {"kind": "grad_norm", "op": None, "cause": None})
    assert f["cause"] == "non-finite"
    settle(f, noise=1)  # a same-degree world: NaN/Inf is judged as a value
    assert f["cause"] == "non-finite"
    settle(f, noise_always=True)  # the reference's own rerun: its noise
    assert f["cause"] == "nondeterministic-kernel" and "nondeterministic run to run" in f["why"]


def test_a_record_read_back_keeps_its_recorded_verdict():
    f = {"cause": "row-parallel-reduction", "kind": "out"}
    assert settle(f).rule == "as recorded (read back from a summary)" and f["cause"] == "row-parallel-reduction"
    settle(f, axis="mode")
    assert f["cause"] == "batch-variant-kernel" and f["layout_cause"] == "row-parallel-reduction"
    with pytest.raises(AssertionError):
        judge.judge(Evidence(row=None, record={}), rules=[])


# copies of a cause the judge wrote (a matrix cell, the baseline's summary line, the records
# frame's column): readers, not judges - (file, the start of the value copied)
_COPIES = {("tpdiag/runner/matrix.py", "fd.get('cause')"), ("tpdiag/diff/analyse.py", "as_noise(fd, degree"),
           ("tpdiag/records/frames.py", "pd.Series([causes.get(")}


def _cause_writes(path: str, text: str) -> list[str]:
    """Where `text` writes a cause: `x["cause"] = ...`, `{"cause": "<label>"}`, `.update(cause=...)`."""
    import ast

    def copied(v) -> bool:  # None, or another record's cause read as it stands
        u = ast.unparse(v)
        return (isinstance(v, ast.Constant) and v.value is None) or u.endswith((".get('cause')", "['cause']"))

    out = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Assign):
            targets = [e for t in node.targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]
            for t in targets:
                if isinstance(t, ast.Subscript) and isinstance(t.slice, ast.Constant) and t.slice.value == "cause":
                    if not any(path == p and ast.unparse(node.value).startswith(v) for p, v in _COPIES):
                        out.append(f"{path}:{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Dict):
            for k, v in zip(node.keys, node.values):
                if isinstance(k, ast.Constant) and k.value == "cause" and not copied(v):
                    out.append(f"{path}:{node.lineno}: a cause {ast.unparse(v)}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "update":
            if any(kw.arg == "cause" for kw in node.keywords):
                out.append(f"{path}:{node.lineno}: {ast.unparse(node)}")
    return out


def test_no_cause_is_written_outside_the_judge():
    import os

    from conftest import ROOT

    found = []
    for d, _, names in os.walk(os.path.join(ROOT, "tpdiag")):
        for n in names:
            rel = os.path.relpath(os.path.join(d, n), ROOT)
            if n.endswith(".py") and rel != os.path.join("tpdiag", "diff", "judge.py"):
                with open(os.path.join(d, n)) as f:
                    found += _cause_writes(rel, f.read())
    assert not found, found
    # negative control: the writes the passes made before the judge are caught
    for snippet in ('fd["cause"] = "attention-kernel"', 'f = {"cause": "router-flip"}', 'f = {"cause": classify(r)}',
                    'f["cause_before"], f["cause"] = f["cause"], "unknown"',
                    'f.update(cause="router-flip", root_cause=False)'):
        assert _cause_writes("x.py", snippet), snippet


def test_an_attention_op_found_later_replaces_the_no_op_reason():
    # an `hf:` decode configuration, as `compare --mode prefill,decode` judged it: the module pass
    # sees o_proj's input differ and no op recorded; the op-level pass then names the SDPA kernel.
    # The reason used to stay "... and no op there was recorded" beside the op it names.
    sdpa = "aten::_scaled_dot_product_flash_attention_for_cpu"
    row = {"phase": "forward", "kind": "in", "style": "rowwise", "cls": "Linear", "name": "0", "step": 0,
           "module": "model.layers.0.self_attn.o_proj", "key": "s0/forward/model.layers.0.self_attn.o_proj/in#0/0",
           "bitwise": False, "beyond_bound": False, "bound": None}
    f = describe(row, {"kind": "in", "cause": None})
    assert f["cause"] == "unknown" and f["why"].endswith("no op there was recorded")  # nothing named yet
    settle(f, axis="mode", op=sdpa)
    assert f["cause"] == "attention-kernel"
    assert "no op there was recorded" not in f["why"] and sdpa in f["why"] and judge.WHY_DECODE in f["why"]
    # the second pass's verdict and the op-level pass's name keep the same reason
    settle(f, second=(f["cause"], f["why"]), op_pass=(sdpa, "attention-kernel"))
    assert f["cause"] == "attention-kernel" and "no op there was recorded" not in f["why"] and sdpa in f["why"]
    # at TP > 1 the reason is the call shape, not decode's positions
    g = describe(row, {"kind": "in", "cause": None})
    settle(g, op=sdpa)
    assert g["cause"] == "attention-kernel" and sdpa in g["why"] and "fewer heads per call" in g["why"]
