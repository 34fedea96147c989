"""Shares of an activation grad behind a router flip: judged on the token rows the flip left alone.

An activation grad each rank holds as its share of a sum the backward reduces later (a hand-split
MoE's router logits grad: each rank's experts' part) is read by diff/partials.py's share tests over
the whole tensor. Where a router chose other experts for some tokens at this degree (a flip: an
expert-assignment record whose top-k sets differ, diff/router.py), those tokens' rows of every grad
of that step are another computation - no share of the reference's rows, beyond any share band - so
a CORRECT split read BUG `rank-inconsistent-replica` (tests/models/planted/moe_zloss_flip.py:
zloss_share, bf16 --tp 1,2). The rows of the other tokens are the same computation: the share tests
are run on them alone (`rank_partial_flip`, diff/judge.py):

  the other rows add up element by element   `router-flip`: shares of a sum, the flipped rows the
                                              flip's consequence (as a beyond-bound finding after a
                                              flip reads, router.relabel_after)
  only within the band (partials.near_shares) `unknown`: neither rounding nor a wrong share shown
  not even that                               no mark: the replica check's BUG stands, a wrong share
                                              on rows the flip did not touch

Which rows: the union of the step's flipped tokens, where every flip of the step counted its tokens
alike and the grad's leading dims hold exactly that many rows (token-major, as a router flattens its
input); a flip whose tokens are not recorded (hash capture), tokens counted otherwise, or a grad of
another row count: no mark (the BUG stands, as before - fail closed).

An op that mixes a sequence's tokens between the flip and the grad (attention, a causal scan or conv, a
sequence mean, in a later layer: before the grad in backward) carries the flipped tokens' change into the
other rows of their sequences - forward into the later rows, backward into every row, whose grad reads
every later row's - so those rows are no more a share of the reference's than the flipped ones
(tests/moe_token_mixer.py:moe_mix_ok, a correct split, read BUG). The records do not show which op mixes which
rows, so where the other rows do not add up (not even within the band) the test is run again without
every row of a sequence holding a flipped token: rows of the sequences no flip touched read no flipped
row through any such op, and are judged as above (`sequences` in the mark). Token t is in sequence t // S,
S the batch's sequence length (its [B, S] token ids, recorded first): the grad's rows are [B, S] or
flattened batch-major; a grad [S, B] (sequence-first), no batch record, or every sequence flipped: no
mark (the BUG stands). Not covered: an op mixing rows ACROSS sequences (a statistic over the batch, an
expert capacity counted over every token) - the rows of the other sequences then move too and the BUG
stands, a correct model included; and a wrong share confined to the flipped sequences' rows is not
judged (the other sequences' rows are). Under --capture hash pass 1 has the grad's per-rank
hashes only (BUG); the region pass reads it whole and marks it here, and its verdict replaces pass 1's
(runner/drill_merge._judged_whole)."""
from __future__ import annotations

import torch

from tpdiag.diff import partials
from tpdiag.records.labels import flipped

MAX_LISTED = 16  # token rows named in the reason; the count is always whole
WHY_HEAD = "a router flip changed token rows "  # why()'s opening


def flipped_tokens(a: torch.Tensor, b: torch.Tensor) -> tuple[int, set] | None:
    """(tokens counted, the tokens whose top-k expert SET differs) of an expert-assignment pair
    [..., k]; None where the pair cannot say (no k axis, shapes differ). The same experts in
    another order are no flip (the combine weights follow the experts)."""
    if a.dim() == 0 or a.shape != b.shape or a.is_floating_point():
        return None
    k = a.shape[-1]
    ia, ib = a.reshape(-1, k), b.reshape(-1, k)
    differs = (ia.sort(dim=-1).values != ib.sort(dim=-1).values).any(dim=-1)
    return ia.shape[0], set(differs.nonzero().flatten().tolist())


def _token_rows(shape, n: int) -> bool:
    """Whether a record of this shape holds n token rows in its leading dims ([T, ...] or [B, S, ...])."""
    prod = 1
    for d in shape[:-1]:
        prod *= d
        if prod == n:
            return True
        if prod > n:
            return False
    return False


class Flips:
    """The router flips seen so far in one degree's diff, by step (the diff walks records in
    execution order: a step's forward before its backward)."""

    def __init__(self):
        # step -> (tokens counted, flipped tokens), or None where they cannot be told
        self.steps: dict = {}
        self.seq_len: int | None = None  # the batch's sequence length (its [B, S] token ids), where recorded

    def note(self, row: dict, a: torch.Tensor | None = None, b: torch.Tensor | None = None) -> None:
        """Note `row` if it is an expert assignment that differs (records/labels.flipped), or the batch's
        token ids (their sequence length); a and b its pair, or None (hash capture: which tokens is not
        recorded)."""
        if row.get("kind") == "batch" and a is not None and self.seq_len is None \
                and a.dim() == 2 and not a.is_floating_point() and a.shape[1] > 0:
            self.seq_len = int(a.shape[1])
            return
        if not flipped(row):
            return
        step = row.get("step")
        got = flipped_tokens(a, b) if a is not None and b is not None else None
        if got is None:
            self.steps[step] = None
            return
        n, tokens = got
        if not tokens:
            return
        have = self.steps.get(step, (n, set()))
        if have is None or have[0] != n:
            self.steps[step] = None  # flips that count tokens otherwise: which rows is not told
            return
        self.steps[step] = (n, have[1] | tokens)

    def mark(self, row: dict, ref: torch.Tensor, copies: list) -> None:
        """Mark an activation grad whose ranks' copies the share tests did not place (no
        rank_partial_sum / _extreme / _near) `rank_partial_flip` where the rows of the step's
        unflipped tokens hold shares (the module doc)."""
        if (row.get("phase"), row.get("kind")) != ("backward", "grad_out") or row.get("rank_consistent") is not False:
            return
        if any(row.get(k) for k in ("rank_partial_sum", "rank_partial_extreme", "rank_partial_near")):
            return
        got = self.steps.get(row.get("step"))
        if not got or not ref.is_floating_point() or len(copies) < 2 or any(c.shape != ref.shape for c in copies):
            return
        n, tokens = got
        if not _token_rows(list(ref.shape), n) or len(tokens) >= n:
            return
        left = [t for t in range(n) if t not in tokens]
        got = _judged(ref, copies, n, left)
        seqs = None
        if got is None:
            # a wrong share on an unflipped row - or an op that mixes tokens (attention, a causal scan, a
            # sequence mean) between the flip and this grad, which carried the flipped rows' change into
            # the other rows of their sequences: those rows read the flipped ones, so they are no more
            # judged than those; the rows of the sequences no flip touched still are (module doc)
            seqs = _sequences(tokens, n, list(ref.shape), self.seq_len)
            if seqs is None:
                return
            s = seqs[1]
            left = [t for t in range(n) if t // s not in seqs[0]]
            got = _judged(ref, copies, n, left) if left else None
            if got is None:
                return
        adds, sum_off, off, band = got
        row["rank_partial_flip"] = {"tokens": sorted(tokens)[:MAX_LISTED], "n_flipped": len(tokens), "rows": n,
                                    "near": not adds, "sum_max_abs": sum_off, "copy_max_abs": off, "band": band}
        if seqs is not None:
            row["rank_partial_flip"].update(sequences=sorted(seqs[0])[:MAX_LISTED], n_sequences=len(seqs[0]),
                                            seq_len=seqs[1], rows_left=len(left))


def _judged(ref: torch.Tensor, copies: list, n: int, left: list) -> tuple | None:
    """(adds up element by element, the sum's max abs off, a copy's, the band) of the ranks' copies on
    token rows `left` of n, where they add up or add up within the share band; None where not even that."""
    keep = torch.zeros(n, dtype=torch.bool)
    keep[left] = True
    r = ref.to(torch.float64).reshape(n, -1)[keep]
    c64 = torch.stack([c.to(torch.float64).reshape(n, -1)[keep] for c in copies])
    off, sum_off, adds = partials.adds_up(c64, r, ref.dtype)
    band = partials.near_band(c64, r, ref.dtype)
    if not adds and not sum_off <= band < off:
        return None
    return adds, sum_off, off, band


def _sequences(tokens: set, n: int, shape: list, seq_len: int | None) -> tuple[set, int] | None:
    """(the sequences of the flipped tokens, the sequence length) where the grad's n token rows are the
    batch's sequences one after another (token t in sequence t // S: [B, S, ...], or [B*S, ...] flattened
    batch-major, as a router flattens [B, S, D]); None where that cannot be told (no batch recorded,
    rows of another count) - the BUG stands."""
    s = seq_len
    if s is None or s < 1 or n % s:
        return None
    if len(shape) >= 3 and shape[0] * shape[1] == n and shape[1] != s:
        return None  # [S, B, ...] or another split: which rows are a sequence is not told
    seqs = {t // s for t in tokens}
    return seqs, s


def why(m: dict) -> str:
    """The reason of a grad marked rank_partial_flip (diff/judge.py)."""
    rows = ", ".join(str(t) for t in m["tokens"]) + (", ..." if m["n_flipped"] > len(m["tokens"]) else "")
    head = (f"{WHY_HEAD}{rows} ({m['n_flipped']} of {m['rows']}: other experts chosen "
            "at this degree): those rows are another computation, no share of the reference's; ")
    left = m["rows"] - m["n_flipped"]
    if m.get("sequences") is not None:
        seqs = ", ".join(str(q) for q in m["sequences"]) + (", ..." if m["n_sequences"] > len(m["sequences"]) else "")
        left = m["rows_left"]
        head += (f"the other rows do not add up, and an op that mixes a sequence's tokens (attention, a scan, "
                 f"a sequence mean) carries the flip into every row of its sequence, so the rows of sequence(s) "
                 f"{seqs} ({m['n_sequences']} x {m['seq_len']} rows) are not judged either; ")
    if not m["near"]:
        return head + (f"on the other {left} rows the ranks' copies add up to the reference's value within "
                       f"roundings ({m['sum_max_abs']:.2e}; a single copy is up to {m['copy_max_abs']:.2e} from "
                       "it): each rank's share of a sum the backward reduces later, the flipped rows the flip's "
                       "consequence")
    return head + (f"on the other {left} rows the ranks' copies add up to the reference's value to within "
                   f"{m['sum_max_abs']:.2e} (a single copy is up to {m['copy_max_abs']:.2e} from it), not within "
                   "the rounding of each element's own magnitude, and the terms that cancel in it are not "
                   f"recorded: shares not judged - neither rounding nor a wrong share is shown (within "
                   f"{m['band']:.2e}, 4 roundings of those rows' largest |shares| + |reference|, a bound that "
                   "would pass a wrong share too)")
