"""Bug or rounding, per degree and for the run: the headline a user reads first.

Each configuration's class comes from its root findings (those no earlier difference explains)
and its first divergence: any bug-class cause makes it `bug`, a non-finite one `non-finite`;
otherwise an unjudged first divergence is `unknown`, and a judged one `rounding`. The run's
class is the worst over its configurations (bug, non-finite, unknown, rounding).
"""
from __future__ import annotations

from tpdiag.records.causes import cause_class

_ORDER = ("bug", "non-finite", "unknown", "rounding")


def degree_class(entry: dict) -> str | None:
    if entry.get("status") != "divergent":
        return None
    fd = entry.get("first_divergence") or {}
    causes = [f.get("cause") for f in entry.get("findings") or [] if "follows" not in f]
    classes = {cause_class(c) for c in causes} | ({cause_class(fd.get("cause"))} if fd else set())
    for c in _ORDER:
        if c in classes:
            return c
    return "unknown"


def add_classes(summary: dict) -> dict:
    """Set degrees[*]['class'] and summary['class'] (None when nothing diverged)."""
    found = set()
    from tpdiag.records.axes import entries

    for entry in entries(summary).values():
        c = degree_class(entry)
        entry["class"] = c
        if c:
            found.add(c)
    summary["class"] = next((c for c in _ORDER if c in found), None)
    return summary


def leading_bug(entry: dict) -> dict | None:
    """The record a reader should see first: the first bug-class (or non-finite) root finding -
    or the first divergence when that is one - else None. A harmless reordering before it is
    not what the verdict is about."""
    fd = entry.get("first_divergence") or {}
    if cause_class(fd.get("cause")) in ("bug", "non-finite"):
        return fd
    roots = [f for f in entry.get("findings") or [] if "follows" not in f]
    for want in ("bug", "non-finite"):
        hit = next((f for f in roots if cause_class(f.get("cause")) == want), None)
        if hit is not None:
            return hit
    return None
