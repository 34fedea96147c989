"""The cause registry (records/causes.py) is the one table of what a cause is: its class, its
explanation, its short name and its advice. A cause added to it - here, in the test - is
accepted by the gate's policy, classed, explained by the report and shortened by the CLI's
matrix, with no other table touched (the negative control: the same label unregistered is refused
and explained as unknown). docs/causes.md and DESIGN.md name exactly the registered labels.
"""
import io
import os
import re

import pytest
from conftest import ROOT

from tpdiag.errors import BadInput
from tpdiag.records import causes
from tpdiag.records.causes import Cause

TOY = Cause("toy-replica-bug", "bug", "the toy replica was written by one rank only",
            short="toy-bug", action="Write the toy replica on every rank.")


def _effects(tmp_path) -> dict:
    from rich.console import Console

    from tpdiag.cli.tables import matrix_table
    from tpdiag.gate.policy import Policy, load_policy, with_allowed
    from tpdiag.reports.words import verdict

    out = {"class": causes.cause_class(TOY.label)}
    pol = tmp_path / "policy.toml"
    pol.write_text(f'allow_causes = ["{TOY.label}"]\n')
    try:
        out["policy"] = load_policy(str(pol)).allow_causes == (TOY.label,)
    except BadInput:
        out["policy"] = False
    out["preset"] = TOY.label in with_allowed(Policy(), "rounding").allow_causes
    fd = {"cause": TOY.label, "phase": "forward", "module": "m", "kind": "out", "step": 0, "max_abs": 1.0}
    v = verdict("2", "1", {"status": "divergent", "first_divergence": fd}, lambda c, op: (None, False))
    out["why"] = TOY.why in v["why"]
    out["action"] = v["action"] == TOY.action
    buf = io.StringIO()
    cell = {"status": "divergent", "first_divergence": fd}
    matrix_table(Console(file=buf, width=200), {"reference": "1", "degrees": ["1", "2"], "variants": ["stock"],
                                                 "cells": {"stock": {"1": {"status": "bitwise"}, "2": cell}}})
    out["short"] = TOY.short in buf.getvalue()
    return out


def test_a_new_cause_is_one_registry_entry(tmp_path, monkeypatch):
    monkeypatch.setitem(causes.REGISTRY, TOY.label, TOY)
    assert _effects(tmp_path) == {"class": "bug", "policy": True, "preset": False, "why": True,
                                  "action": True, "short": True}


def test_negative_control_the_same_label_unregistered(tmp_path):
    assert TOY.label not in causes.REGISTRY
    assert _effects(tmp_path) == {"class": "rounding", "policy": False, "preset": False, "why": False,
                                  "action": False, "short": False}


def test_a_rounding_cause_joins_the_rounding_preset(monkeypatch):
    from tpdiag.gate.policy import Policy, with_allowed

    monkeypatch.setitem(causes.REGISTRY, "toy-reorder", Cause("toy-reorder", "rounding", "a toy reordering"))
    assert "toy-reorder" in with_allowed(Policy(), "rounding").allow_causes
    assert causes.get("toy-reorder").short == "toy-reorder"  # no short name: the label


def test_a_bad_class_is_refused():
    with pytest.raises(ValueError, match="class 'harmless'"):
        Cause("x", "harmless", "")


def test_the_classes_are_the_contract():
    assert causes.of_class("bug") == ("rank-inconsistent-replica", "sharding-bug")
    assert causes.of_class("non-finite") == ("non-finite",)
    assert causes.of_class("unknown") == ("unknown",)
    assert causes.cause_class(None) == "unknown" and causes.get(None).label == "unknown"


def test_every_cause_a_fix_removes_is_registered():
    from tpdiag.fixes.registry import catalogue

    named = {c for f in catalogue().values() for c in f.fixes}
    assert named <= set(causes.labels()), named - set(causes.labels())


def _ticked(text: str) -> set:
    return set(re.findall(r"`([a-z0-9-]+)`", text))


def test_docs_causes_table_names_exactly_the_registry():
    text = open(os.path.join(ROOT, "docs", "causes.md")).read()
    start = text.index("## Cause labels")
    table = re.findall(r"^\| `([a-z0-9-]+)` \|", text[start:text.index("\n## ", start + 1)], re.M)
    assert sorted(table) == sorted(causes.labels())
    # the classes paragraph: bug and non-finite as the registry has them
    bug = re.search(r"\*\*bug\*\* \(([^)]*)\)", text).group(1)
    assert _ticked(bug) == set(causes.of_class("bug"))


def _design() -> str:
    for p in (os.path.join(ROOT, "..", "shared", "DESIGN.md"), os.path.join(ROOT, "..", "..", "shared", "DESIGN.md")):
        if os.path.isfile(p):
            return open(p).read()
    pytest.skip("DESIGN.md (the project's shared contract) is not beside this checkout")


def test_design_names_exactly_the_registry():
    text = _design()
    start = text.index("## Causes (stable labels)")
    section = text[start:text.index("\n## ", start + 1)]
    assert _ticked(section) == set(causes.labels())
    bug = re.search(r"\*\*bug\*\* \(([^)]*)\)", section).group(1)
    assert _ticked(bug) == set(causes.of_class("bug"))
