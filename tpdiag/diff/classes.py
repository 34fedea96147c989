"""Bug or rounding, per degree and for the run: the headline a user reads first.

Each configuration's class comes from its root findings (those no earlier difference explains)
and its first divergence: any bug-class cause makes it `bug`, a non-finite one `non-finite`;
otherwise an unjudged first divergence is `unknown`, and a judged one `rounding`. The run's
class is the worst over its configurations (bug, non-finite, unknown, rounding).
"""
from __future__ import annotations

from tpdiag.diff.moved_limit import moved_beyond
from tpdiag.records.causes import GRAVITY, cause_class, groups_under

_ORDER = GRAVITY


def roots(findings: list, fd: dict | None = None) -> list:
    """The findings no other explains: those that follow nothing, those that follow one less grave
    than they are (records/causes.groups_under, the gate's rule: an `unknown` under a rounding
    finding, a bug under an `unknown` - the gate judges each on its own), those that follow a record
    that is neither a finding nor the first divergence `fd` (the gate groups nothing under it), and
    those whose `follows` chain comes back to them (two findings each said to follow the other
    explain neither - counted as roots, so the class fails closed: such a cycle once read 'rounding
    only' where `gate` read BUG)."""
    by_key = {f.get("key"): f for f in findings if f.get("key")}
    if fd and fd.get("key") and fd["key"] not in by_key:
        by_key[fd["key"]] = fd
    out = []
    for f in findings:
        up = by_key.get(f["follows"]) if "follows" in f else None
        if up is None or up is f or not groups_under(f.get("cause"), up.get("cause")):
            out.append(f)
            continue
        seen, g = set(), f
        while "follows" in g and id(g) not in seen:
            seen.add(id(g))
            g = by_key.get(g["follows"])
            if g is None:
                break
        if g is f:
            out.append(f)
    return out


def degree_class(entry: dict) -> str | None:
    if entry.get("status") != "divergent":
        return None
    fd = entry.get("first_divergence") or {}
    causes = [f.get("cause") for f in roots(entry.get("findings") or [], fd)]
    classes = {cause_class(c) for c in causes} | ({cause_class(fd.get("cause"))} if fd else set())
    if entry.get("downstream_unjudged") and classes <= {"rounding"}:
        return "unknown"  # modules past the first divergence that were to be judged were not
    if classes <= {"rounding"} and moved_beyond(entry):
        return "unknown"  # grads no check judged moved beyond rounding (diff/not_judged.py): the gate fails them
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


def class_problems(summary: dict) -> list[str]:
    """summary.json's classes (bug / non-finite / unknown / rounding) must be what its own causes give:
    the CLI's and the report's headline reads them, so a bug run edited to class "rounding" (or None)
    would lead with rounding over its sharding-bug findings. `--fix auto`'s top-level class is the chain's
    last round's (runner/session.py), so only its per-configuration classes are re-derived. Only a class
    milder than its causes' is a problem: one graver than them hides nothing (the gate judges the causes
    themselves), and findings edited to `follows` are the gate's to catch (tests/test_tamper_findings.py)."""
    from tpdiag.records.axes import entries

    def milder(said, want) -> bool:
        rank = {c: i for i, c in enumerate(_ORDER)}
        return rank.get(said, len(_ORDER)) > rank.get(want, len(_ORDER))

    out, found = [], set()
    for lab, entry in entries(summary).items():
        if not isinstance(entry, dict):
            continue
        want = degree_class(entry)
        if want:
            found.add(want)
        if "class" in entry and milder(entry["class"], want):
            out.append(f"summary.json says TP={lab} is class {entry['class']!r} but its causes give {want!r} "
                       "(edited after the run)")
    want = next((c for c in _ORDER if c in found), None)
    if "class" in summary and "fix_chain" not in summary and milder(summary["class"], want):
        out.append(f"summary.json says the run is class {summary['class']!r} but its causes give {want!r} "
                   "(edited after the run)")
    return out


def leading_bug(entry: dict) -> dict | None:
    """The record a reader should see first: the first bug-class (or non-finite) root finding -
    or the first divergence when that is one - else None. A harmless reordering before it is
    not what the verdict is about."""
    fd = entry.get("first_divergence") or {}
    if cause_class(fd.get("cause")) in ("bug", "non-finite"):
        return fd
    first = roots(entry.get("findings") or [], fd)
    for want in ("bug", "non-finite"):
        hit = next((f for f in first if cause_class(f.get("cause")) == want), None)
        if hit is not None:
            return hit
    return None


def no_sharding_at_tp1(entry: dict) -> None:
    """Two worlds at TP=1 (a micro-batch or decode configuration beside its reference): nothing
    is sharded, and the grad norm's triangle bound models its rounding as log2-deep sums, too
    tight for a GPU's serial reduce runs (llama-1b on an H200: 1.01x its bound). A grad norm
    beyond it is a bug only where a float64 re-execution found it wrong. Any other record keeps
    its verdict: a Linear's or a norm's bound holds for any summation order, so a record far
    beyond it between two TP=1 worlds is a wrong result (two captures of different code, a
    micro-batch loss scaled wrongly), whatever its label."""
    from tpdiag.diff.judge import settle

    for f in [entry.get("first_divergence")] + list(entry.get("findings") or []):
        if f:
            settle(f, tp1_both=True)  # the judge's rule "grad norm beyond its bound at TP=1"


def clear_by_confirmation(entry: dict, bitwise_after: set[str]) -> None:
    """After a confirmed fix (its first divergence bitwise under fixes that only reorder): a bug
    finding that the fixes make bitwise is not a bug - a reordering cannot turn a wrong result
    right - and neither is one downstream of the confirmed cause that no float64 re-execution
    found within rounding (its layout bound assumed inputs that were equal; they carried the
    rounding). A downstream record that no re-execution judged keeps its bug verdict. The rules
    are the judge's (diff/judge.py); this gives it the confirmation."""
    from tpdiag.diff.judge import settle

    conf = entry.get("confirmation") or {}
    fd = entry.get("first_divergence") or {}
    if conf.get("verdict") != "confirmed" or cause_class(fd.get("cause")) != "rounding":
        return
    for f in entry.get("findings") or []:
        settle(f, confirmed={"fix": conf.get("fix"), "cause": fd["cause"], "bitwise": f.get("key") in bitwise_after})
