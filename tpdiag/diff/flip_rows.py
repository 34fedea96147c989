"""Which token rows of a forward record a router flip can reach, and whether the others are rounding.

diff/router.relabel_after points a finding after a router flip back to the flip: a token that ran other
experts is beyond any rounding bound from there on. That holds for the flipped tokens' rows only; a
real mistake after the flip (a row-parallel MLP adding its replicated bias at every rank) moves EVERY
row, and relabelled `router-flip` it passed `gate --allow rounding` (tests/moe_flip_forward.py, --forward-only:
exit 0). So a forward finding of the flip's own step is relabelled only where its difference is
confined to the rows the flip can reach:

  the flipped tokens' rows          their expert choice changed (flip_shares.Flips: the union of the
                                    step's flips, each counting its tokens alike)
  ... or their whole sequences      where the other rows move beyond the bound too: an op that mixes a
                                    sequence's tokens (attention, a scan, a sequence mean) between the
                                    flip and the record carries it into the later rows of its sequence
                                    (token t in sequence t // S, S the batch's [B, S] token ids)

The other rows are judged by the bound the finding was judged with, applied to those rows alone: the
float64 re-execution's verdict (diff/oracle_verdict.judge, or judge_own from this side's own inputs)
formed on their rows of the record and of the float64 value. Bitwise equal there: confined, no bound
needed. Far there: the finding stays what its own evidence says (a BUG), with the rows in `flip_rows`.

Other rows beyond the bound where the sequences are not told (no batch recorded, a record [S, B, ...], every
sequence flipped): `confined` None, the finding `unknown` (fail closed: neither the flip's nor a bug shown).
Not told (None: the caller keeps today's relabelling): a record whose leading dims do not hold the
step's token rows ([T, ...] or [B, S, ...]), a step whose flips' tokens are not recorded (hash capture)
or count tokens otherwise, a record of another step or of the backward (a grad of every row reads the
flipped rows: flip_shares.py judges shares there), a bound that is no float64 verdict (a layout's
elementwise bound is not kept per element), a float64 verdict with a discrete choice inside (oracle_flip:
the float64 run may choose otherwise on any token)."""
from __future__ import annotations

import torch

from tpdiag.diff import flip_shares


def flips_of(dd) -> flip_shares.Flips:
    """The degree's router flips by step, and its batch's sequence length, from its rows and tensors."""
    fl = flip_shares.Flips()
    for r in dd.rows:
        pair = dd.tensors.get(r["key"]) if r.get("key") is not None else None
        fl.note(r, *(pair if pair is not None else (None, None)))
    return fl


def _verdict(dd, row: dict, keep: torch.Tensor, n: int):
    """The finding's float64 verdict formed on the token rows `keep` of n alone: {far, ratio, rows}, or
    None where it is not one the rows can be held to (module doc)."""
    from tpdiag.diff.oracle_verdict import judge, judge_own

    k = row["key"]
    v = row.get("oracle")
    if not isinstance(v, dict) or row.get("oracle_flip") or v.get("discrete"):
        return None
    y_ref, y_n = dd.tensors[k]

    def rows(t):
        return t.reshape(n, -1)[keep] if t is not None and tuple(t.shape) == tuple(y_ref.shape) else None

    a, b = rows(y_ref), rows(y_n)
    if a is None or b is None:
        return None
    if torch.equal(a, b):
        return {"far": False, "ratio": 0.0, "bitwise": True}
    if v.get("own"):
        o_n = rows(dd.oracle_own.get(k))
        if o_n is None:
            return None  # judged from norms only (own_side): no value per row
        got = judge_own(a, b, rows(dd.oracle.get(k)), o_n)
    else:
        o = rows(dd.oracle.get(k))
        got = judge(a, b, o) if o is not None else None
    return None if got is None else {"far": bool(got["far"]), "ratio": float(got["ratio"]), "bitwise": False}


def confined(dd, row: dict | None, fl: flip_shares.Flips) -> dict | None:
    """{confined: bool, ...} for a forward record after a flip of its own step (module doc): confined
    where the rows the flip cannot reach are within the finding's bound; None where that is not told."""
    if row is None or row.get("phase") != "forward" or row.get("key") not in dd.tensors:
        return None
    got = fl.steps.get(row.get("step"))
    if not got:
        return None
    n, tokens = got
    a, _ = dd.tensors[row["key"]]
    if not a.is_floating_point() or not flip_shares._token_rows(list(a.shape) + [1], n) or len(tokens) >= n:
        return None
    keep = torch.ones(n, dtype=torch.bool)
    keep[sorted(tokens)] = False
    v = _verdict(dd, row, keep, n)
    if v is None:
        return None
    out = {"tokens": sorted(tokens)[:flip_shares.MAX_LISTED], "n_flipped": len(tokens), "rows": n,
           "rows_left": int(keep.sum()), "ratio": v["ratio"], "bitwise": v["bitwise"]}
    if not v["far"]:
        return {**out, "confined": True}
    # an op mixing a sequence's tokens carries the flip into its sequence: the sequences it did not touch
    # no batch recorded, or a record [S, B, ...]: which rows a mixer reached is not told - fail closed
    seqs = flip_shares._sequences(tokens, n, list(a.shape), fl.seq_len)
    if seqs is None:
        return {**out, "confined": None}
    s = seqs[1]
    keep = torch.tensor([t // s not in seqs[0] for t in range(n)])
    w = _verdict(dd, row, keep, n) if bool(keep.any()) else None
    if w is None:
        return None
    out.update(sequences=sorted(seqs[0])[:flip_shares.MAX_LISTED], n_sequences=len(seqs[0]), seq_len=s,
               rows_left=int(keep.sum()), ratio=w["ratio"], bitwise=w["bitwise"])
    return {**out, "confined": not w["far"]}
