"""summary.json's numbers and findings against diff.csv's rows: the numbers the report prints must be
diff.csv's for the same record, and every record beyond its bound or inconsistent across ranks must be a
finding with a bug label unless a later pass relabelled it (records/integrity.py reads this first)."""
from __future__ import annotations


def _num(v):
    """A summary number as a float: JSON carries Inf/NaN as the strings "Infinity"/"NaN" (io.json_safe)."""
    if isinstance(v, str) and v in ("Infinity", "-Infinity", "NaN"):
        return float(v.replace("Infinity", "inf"))
    return v


def same(a, b) -> bool:
    a, b = _num(a), _num(b)
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True
    if type(a) in (int, float) and type(b) in (int, float):
        return float(a) == float(b)  # CSV and JSON both write floats by repr: exact
    return a == b




def confirmation_of(f: dict) -> str | None:
    """The fix whose confirmation rerun found this finding (runner/confirm.py files a bug its rerun
    found as "confirmation (FIX)"): its numbers are that rerun's diff.csv's, measured under the
    fixes, not this run's (an ulp apart where the fix reorders the sums before it)."""
    w = f.get("from")
    if isinstance(w, str) and w.startswith("confirmation (") and w.endswith(")"):
        return w[len("confirmation ("):-1]
    return None


def confirmation_problems(degrees: dict, rows_of) -> list[str]:
    """Each finding a confirmation rerun found against that rerun's own diff.csv (rows_of(fix):
    its rows, or None when it has none to read - then the finding is no evidence)."""
    out, read = [], {}
    for lab, d in degrees.items():
        if not isinstance(d, dict):
            continue
        for f in d.get("findings") or ():
            fix = confirmation_of(f) if isinstance(f, dict) else None
            if fix is None:
                continue
            if fix not in read:  # one read of each confirmation's diff.csv
                read[fix] = rows_of(fix)
            rows = read[fix]
            sub = str(f.get("confirm_label") or lab)  # the rerun's own label for this configuration
            r = None if rows is None else next(
                (r for r in rows if str(r.get("degree")) == sub and r.get("key") == f.get("key")), None)
            if r is None:
                out.append(f"summary.json's TP={lab} finding {f.get('key')} from the confirmation by {fix} "
                           "is not a record of that confirmation's diff.csv")
                continue
            bad = next((k for k in ("max_abs", "bound") if k in f and r.get(k) is not None and not same(f[k], r[k])),
                       None)
            if bad:
                out.append(f"summary.json's TP={lab} finding {f.get('key')}: {bad} {f[bad]!r} but the confirmation's "
                           f"diff.csv says {r[bad]!r} (edited after the run)")
    return out


def unkeyed(d: dict) -> str | None:
    """The first divergence or a finding that names no record (no string `key`): every check here and in
    records/labels.py, integrity.py and diff/overrides.py finds a finding's record by its key and passes
    over one without, so a keyless rounding copy of a BUG's finding - or the bug's own finding and first
    divergence with their keys deleted and relabelled rounding - was checked by nothing while the gate
    judged diff.csv's row by the copy (red team hred21: `gate --allow rounding` exit 0 on
    tests/models/planted/backward.py:averaged). locate, the second pass and rollout write a key on each."""
    fd = d.get("first_divergence")
    if isinstance(fd, dict) and not (isinstance(fd.get("key"), str) and fd["key"]):
        return "first divergence"
    for f in d.get("findings") or ():
        if not isinstance(f, dict) or not (isinstance(f.get("key"), str) and f["key"]):
            return f"finding {f.get('module') if isinstance(f, dict) else f!r}"
    return None


def number_problems(degrees: dict, rows: list[dict] | None) -> list[str]:
    """The numbers summary.json shows (the first divergence's and each finding's max abs, ULP, mismatch
    fraction, bound) must be diff.csv's for the same record: the report prints them as written, so an
    edit to summary.json alone (a divergence edited to 0 ULP) must not read as evidence. A finding
    of the second pass (an op inside the module: `.../op#0/aten::mul#0.0`) is checked against that
    pass's summary by _second_pass_problems."""
    if rows is None:
        return []
    by_key = {(str(r.get("degree")), r.get("key")): r for r in rows}
    out = []
    for lab, d in degrees.items():
        if not isinstance(d, dict):
            continue
        nameless = unkeyed(d)
        if nameless:
            out.append(f"summary.json's TP={lab} {nameless} has no record key (compare names every one by its "
                       "record; edited after the run)")
            continue
        fd = d.get("first_divergence") if isinstance(d.get("first_divergence"), dict) else None
        recs = [("first divergence", fd, ("max_abs", "max_ulp", "mismatch_fraction", "bound"))] if fd else []
        # a second pass's finding is a record of that pass's own diff.csv (an op it alone recorded):
        # _second_pass_problems checks it against that pass's summary
        recs += [("finding", f, ("max_abs", "bound")) for f in d.get("findings") or ()
                 if isinstance(f, dict) and f.get("key") and f.get("cause") != "router-flip"
                 and f.get("from") != "second pass" and confirmation_of(f) is None]
        # the first record the ranks hold only part of has no diff.csv row (it was never compared): its key
        # the gate re-derives from the records (diff/recheck.py), its finding is checked there (gate/evidence.py)
        brk = d.get("shape_break") if isinstance(d.get("shape_break"), dict) else {}
        for what, rec, fields in recs:
            key = rec.get("key")
            if not key or key == brk.get("key"):
                continue
            r = by_key.get((lab, key))
            if r is None:
                out.append(f"summary.json's TP={lab} {what} {key} is not a record of diff.csv")
                break
            if what == "finding" and r.get("rank_consistent") is False:
                fields = ("bound",)  # its max abs is between the ranks' copies, not in diff.csv
            bad = next((k for k in fields if k in rec and r.get(k) is not None and not same(rec[k], r[k])), None)
            if bad:
                out.append(f"summary.json's TP={lab} {what} {key}: {bad} {rec[bad]!r} but diff.csv says "
                           f"{r[bad]!r} (edited after the run)")
                break
        # locate makes every record beyond its bound or rank-inconsistent a finding: one missing from the
        # summary (a bug deleted) would be judged as a mere consequence of the first divergence
        from tpdiag.records.shares import shares

        # and the records a full capture read as shares of one value (records/shares.py)
        found = {f.get("key") for f in d.get("findings") or () if isinstance(f, dict)} | shares(d)
        lost = next((r["key"] for r in rows if str(r.get("degree")) == lab and r.get("key") not in found
                     and (r.get("beyond_bound") is True or r.get("rank_consistent") is False)), None)
        if lost:
            out.append(f"summary.json's TP={lab} findings lack {lost}, which diff.csv has beyond its bound or "
                       "inconsistent across ranks (edited after the run)")
        # locate names such a record a bug (or non-finite); the passes that name it otherwise say so:
        # the second pass keeps the bug label it overrode (cause_before), the router relabels it
        # unknown or router-flip. A rounding label with neither is an edit that would let it pass.
        from tpdiag.records.causes import cause_class

        far = {r["key"] for r in rows if str(r.get("degree")) == lab
               and (r.get("beyond_bound") is True or r.get("rank_consistent") is False)}
        soft = next((f for f in d.get("findings") or () if isinstance(f, dict) and f.get("key") in far
                     and cause_class(f.get("cause")) not in ("bug", "non-finite") and "cause_before" not in f
                     and f.get("cause") not in ("unknown", "router-flip")), None)
        if soft:
            out.append(f"summary.json's TP={lab} finding {soft.get('key')} has cause {soft.get('cause')!r}, a "
                       "rounding label for a record diff.csv has beyond its bound or inconsistent across ranks "
                       "(edited after the run)")
    return out


def count_problems(degrees: dict, rows: list[dict] | None) -> list[str]:
    """A pass's diff.csv must hold as many rows of each configuration as its summary.json compared
    (n_records) and as many divergent ones (n_divergent): a second pass's diff.csv is not re-derived from
    its records, and one cut short (a half-written disk, a copy that stopped) read as the whole -
    every row beyond its bound that it lost was a finding it no longer demanded (red team hred11:
    region/diff.csv cut in half passed `gate --allow rounding`)."""
    if rows is None:
        return []
    for lab, d in degrees.items():
        if not isinstance(d, dict) or d.get("status") not in ("bitwise", "divergent"):
            continue
        mine = [r for r in rows if str(r.get("degree")) == lab]
        div = sum(1 for r in mine if r.get("bitwise") is not True)  # diff/analyse.py's n_divergent
        for what, have, said in (("rows", len(mine), d.get("n_records")), ("divergent rows", div, d.get("n_divergent"))):
            if isinstance(said, int) and have != said:
                return [f"diff.csv has {have} {what} of TP={lab} but summary.json says {said} (cut short, or "
                        "edited after the run)"]
    return []
