"""A `router-flip` label re-derived from the records (the gate's re-diff), where the records decide it.

records/labels.flip_problems holds a router-flip label to an expert choice that differs at or before it;
that alone let a BUG pass: a record whose ranks' copies disagree (`rank-inconsistent-replica`) relabelled
`router-flip` in summary.json - and in the second pass's summary, whose comparison with summary.json is
skipped in a run with a flip (records/integrity.py: drill.py leaves such findings out on purpose) - passed
`gate --allow rounding`, exit 0 (tests/test_moe_token_mixer.py, moe_mix_late_bug). What the re-diffed rows decide:

  a record the ranks hold differently   router-flip only where its rows say so: the share tests on the rows
                                         a flip left alone add up element by element (rank_partial_flip,
                                         not near: diff/flip_shares.py), or shares that do not add up
                                         (shares_of, a sharding-bug the flip before it explains: judge.py), or a
                                         float64 verdict with a choice inside (oracle_flip, a second pass)
  the expert choice itself               router-flip only after an earlier divergent record (a flip with
                                         nothing before it is `unknown`: diff/router.py)

A finding a later pass made (`from`) is held to that pass's records (diff/recheck_pass.py, second=True).
  a forward record of the flip's step     not router-flip where the re-diff found it beyond its bound on the
                                         rows the flip cannot reach (flip_rows, not confined: diff/flip_rows.py),
                                         or far from float64 runs that made each side's own choices
                                         (diff/choices_made.py)
Not re-derived here: any other beyond-bound record after a flip (any such reads router-flip: judge.py's rule); an
oracle_flip mark is taken as the rows give it (pass 1's re-diff computes none, a second pass's re-diff does)."""
from __future__ import annotations

from tpdiag.records.labels import flipped


def problem(label: str, entry, rows: list[dict], second: bool = False) -> str | None:
    """The first router-flip label of TP=label's entry (first divergence and findings) that the re-diffed
    rows do not give, in words; second: only the findings a later pass made, against that pass's rows."""
    if not isinstance(entry, dict):
        return None
    fd = entry.get("first_divergence")
    labelled = ([fd] if isinstance(fd, dict) else []) + [f for f in entry.get("findings") or () if isinstance(f, dict)]
    by_key = {r["key"]: r for r in rows}
    for f in labelled:
        if f.get("cause") != "router-flip" or ("from" in f) is not second:
            continue
        if second and f.get("from") != "second pass":
            continue
        r = by_key.get(f.get("key"))
        if r is None:
            continue
        if isinstance(r.get("flip_rows"), dict) and r["flip_rows"].get("confined") is not True:
            why = ("a record beyond its bound on the token rows the router flip cannot reach (sharding-bug: "
                   "diff/flip_rows.py)")
        elif (r.get("oracle") or {}).get("choices_made") and r["oracle"].get("far"):
            why = ("a record far from its float64 re-executions, which made each side's own choices, flipped "
                   "tokens included (sharding-bug: diff/choices_made.py)")
        elif flipped(r):
            if any(x["idx"] < r["idx"] and (x.get("bitwise") is False or x.get("rank_consistent") is False)
                   for x in rows):
                continue
            why = "an expert choice that differs with no divergent record before it (unknown: diff/router.py)"
        elif r.get("rank_consistent") is False:
            m = r.get("rank_partial_flip")
            if (isinstance(m, dict) and m.get("near") is False) or r.get("shares_of") or r.get("oracle_flip"):
                continue
            why = ("a record whose ranks' copies differ and whose rows the flip left alone do not add up "
                   "(rank-inconsistent-replica or unknown: diff/flip_shares.py)")
        else:
            continue
        return (f"summary.json's TP={label} {f.get('key')} has cause 'router-flip', but its records re-diffed give "
                f"{why} (edited after the run)")
    return None
