"""Records a hash-first pass read as differing whose whole values, captured by the region pass, are
each rank's share of a value their module makes one on every rank (diff/partials.py): no difference,
left uncompared there (summary.json `not_compared.shares`, runner/drill.py). The summary's list must
be the region pass's own (integrity.py), and the gate and the integrity checks then read those
records as the full capture does: not compared."""
from __future__ import annotations


def shares(d) -> set:
    """The keys of a configuration's records left uncompared as shares (empty when none)."""
    nc = d.get("not_compared") if isinstance(d, dict) else None
    keys = nc.get("shares") if isinstance(nc, dict) else None
    return {k for k in keys if isinstance(k, str)} if isinstance(keys, list) else set()


def shares_problem(lab: str, d: dict, sub_d: dict | None, name: str) -> str | None:
    """summary.json's shares of TP=lab that the second pass (folder `name`) did not read as shares:
    an edit that would let a record differing across ranks pass unjudged."""
    extra = sorted(shares(d) - shares(sub_d or {}))
    if extra:
        return (f"summary.json's TP={lab} not_compared.shares lists {extra[0]}, which {name}/summary.json "
                "does not read as shares (edited after the run)")
    return None
