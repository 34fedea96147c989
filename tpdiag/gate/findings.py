"""Which finding judges a diff.csv row, and which findings are grouped under another (the gate's).

Several findings may name one record (a rounding copy appended after a BUG's, a module called twice):
the gravest judges it. A finding that follows another is grouped under it - never a violation of its
own - only where gate/degree.py may trust that grouping."""
from __future__ import annotations

# how grave a finding's class is: where several findings name one record, the gravest judges it
_GRAVITY = {"non-finite": 4, "bug": 3, "unknown": 2, "rounding": 1}


def gravity(f: dict | None) -> int:
    from tpdiag.records.causes import cause_class

    return 0 if f is None else _GRAVITY.get(cause_class(f.get("cause")), 2)


def by_record(every: list, judged: set) -> dict:
    """{id: the gravest finding of it}: a finding names its record by its key (step, phase, module, kind,
    call and name), or - one whose key is no diff.csv row's - by (step, phase, module, kind, name) as
    before. The gate once kept the last finding of a (step, phase, module, kind, name) - no call index,
    no key - so a rounding copy appended after a BUG's finding (its key deleted, which integrity's
    checks pass over) judged the BUG's row, `gate --allow rounding` exit 0 (red team hred21), and of a
    module called twice one call's finding could judge the other call's row."""
    out: dict = {}
    for f in every:
        k = f.get("key")
        rid = ("key", k) if k in judged else ("row", f.get("step"), f.get("phase"), f.get("module"), f.get("kind"),
                                             f.get("name"))
        if gravity(f) > gravity(out.get(rid)):
            out[rid] = f
    return out


def gravest(found: dict, r: dict) -> dict | None:
    """The gravest finding that judges diff.csv row r (by_record)."""
    a = found.get(("key", r["key"]))
    b = found.get(("row", r["step"], r["phase"], r["module"], r["kind"], r["name"]))
    return a if gravity(a) >= gravity(b) else b


def grouped(f: dict, by_key: dict, fd: dict) -> bool:
    """A finding that follows another is grouped under it - not judged on its own - only where that one
    is a finding (or the first divergence) of this degree that the gate judges (a record of diff.csv, not
    an op only the second pass recorded) and at least as grave (records/causes.groups_under, the rule
    compare's headline groups by: an `unknown` is never grouped under rounding). locate and the second pass group no other way, so a `follows` written into summary.json
    to hide a bug under a rounding difference (or under nothing) is judged as a finding."""
    from tpdiag.records.causes import cause_class, groups_under

    # the first divergence alone (not itself a finding) is followed only by a finding a later pass judged
    # on its own inputs (runner/drill_own.py: cause_before kept) or one the second pass judged (checked against
    # its summary): locate's own followers name a finding. Written into the rest - or into an `unknown` of the
    # second pass, both summaries edited - it hid bugs relabelled `unknown` (red team hred13).
    fd_root = fd.get("key") == f["follows"] and ("cause_before" in f or (
        f.get("from") == "second pass" and cause_class(f.get("cause")) != "unknown"))
    root = by_key.get(f["follows"]) or (fd if fd_root else None)
    if root is None or root is f:
        return False
    return groups_under(f.get("cause"), root.get("cause"))

