"""The structured names of the share rules' verdicts (diff/judge.py), as summary.json keeps them in a
finding's `rule`: an activation grad whose ranks' copies, read whole, are shares of a sum the backward
reduces later - near the reference only within the share band (diff/partials.near_shares), on the token
rows a router flip left alone (diff/flip_shares.py), or at a step whose weights differ
(diff/partials.drifted_grad_shares).

Where a hash-first pass 1 read such a grad's differing per-rank hashes as a replica's BUG, the region
pass's share verdict replaces it (runner/drill_merge._judged_whole); the gate holds every such
replacement to one of these names, the region pass's own (records/integrity.py,
share_rule_problems). They were told by their reasons' opening words before: prose, which an edit of
a reason's wording broke silently."""
from __future__ import annotations

NEAR_SHARES = "near-shares"
FLIP_SHARES = "flip-shares"
DRIFTED_SHARES = "drifted-shares"
SHARE_RULES = (NEAR_SHARES, FLIP_SHARES, DRIFTED_SHARES)


def share_rule_problems(degrees: dict, rows: list[dict] | None) -> list[str]:
    """A finding of the second pass at a record pass 1's diff.csv holds as per-rank hashes that differ (no
    value: rank_consistent false, no max abs) replaced pass 1's BUG there; only a share rule's verdict does
    (drill_merge._judged_whole), so a softer label without one - or from a run written before the rule was
    kept - is no evidence (fail closed)."""
    from tpdiag.records.causes import cause_class

    if rows is None:
        return []
    hashed = {(str(r.get("degree")), r.get("key")) for r in rows
              if r.get("rank_consistent") is False and r.get("max_abs") is None}
    for lab, d in degrees.items():
        if not isinstance(d, dict):
            continue
        for f in d.get("findings") or ():
            if not isinstance(f, dict) or f.get("from") != "second pass" or (lab, f.get("key")) not in hashed:
                continue
            if cause_class(f.get("cause")) in ("bug", "non-finite") or f.get("rule") in SHARE_RULES:
                continue
            return [f"summary.json's TP={lab} finding {f.get('key')} from the second pass reads {f.get('cause')!r} over "
                    "pass 1's per-rank hashes, but names no share rule that judged the ranks' whole copies "
                    f"(rule {f.get('rule')!r}; edited after the run, or written before tpdiag kept the rule)"]
    return []
