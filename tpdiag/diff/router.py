"""router-flip: an MoE router picked other experts at this degree than at the reference.

A router's top-k is discontinuous: where the k-th and (k+1)-th scores nearly tie, a last-bit
difference in the router's input (a row-parallel reduction upstream, say) swaps an expert, and
from there on that token's activations are a different computation - far beyond any rounding
bound, yet no sharding bug. This file finds such flips from the records alone (the router's
integer top-k output, or the experts module's integer index input, and the router's scores), says
which tokens and experts changed and how close the reference's top-k was to a tie, and points
every finding after the flip back to the flip and the flip back to the first divergence.
"""
from __future__ import annotations

import torch

from tpdiag.diff.judge import describe, settle
# what an expert choice is: the gate checks a router-flip label against it too (records/labels.py)
from tpdiag.records.labels import (EXPERTS_NAMES, ROUTER_NAMES, flipped, is_assignment,  # noqa: F401
                                   is_experts, is_router)

MAX_LISTED = 16  # tokens listed per flip; the count is always whole


def _block(module: str) -> str:
    return module.rpartition(".")[0]


def _scores(dd, row: dict, n_tokens: int, k: int):
    """The router's float scores [tokens, experts] at the reference and here, with their key."""
    block = _block(row["module"]) if is_experts(row) else None
    for r in dd.rows:
        if r["step"] != row["step"] or r["phase"] != "forward" or r["kind"] != "out":
            continue
        if not is_router(r) or (r["module"] != row["module"] and _block(r["module"]) != block):
            continue
        if r["key"] not in dd.tensors:
            continue
        a, b = dd.tensors[r["key"]]
        if not a.is_floating_point() or a.numel() % n_tokens or a.numel() // n_tokens <= k:
            continue
        e = a.numel() // n_tokens
        if a.shape[-1] == e:
            return a.reshape(n_tokens, e), b.reshape(n_tokens, e), r["key"]
    return None, None, None


def analyse(dd, first_divergence: dict | None) -> list[dict]:
    """One finding per MoE block whose expert choice differs, in execution order."""
    out, seen_blocks = [], set()
    for row in dd.rows:
        if not flipped(row):
            continue
        block = (row["step"], row.get("call"), _block(row["module"]))
        if block in seen_blocks:
            continue  # the router's output and the experts' input are the same choice
        if row["key"] not in dd.tensors:  # hash capture: the choice changed, not known where
            seen_blocks.add(block)
            out.append(_hash_only(row, first_divergence))
            continue
        a, b = dd.tensors[row["key"]]
        if a.dim() == 0 or a.shape != b.shape:
            continue
        k = a.shape[-1]
        ia, ib = a.reshape(-1, k), b.reshape(-1, k)
        sa, sb = ia.sort(dim=-1).values, ib.sort(dim=-1).values
        tokens = (sa != sb).any(dim=-1).nonzero().flatten().tolist()
        if not tokens:
            continue  # the same experts in another order: the combine weights say the rest
        seen_blocks.add(block)
        s_ref, s_here, score_key = _scores(dd, row, ia.shape[0], k)
        experts, margins = [], []
        for t in tokens[:MAX_LISTED]:
            e = {"token": t, "reference": sorted(ia[t].tolist()), "this": sorted(ib[t].tolist())}
            if s_ref is not None:
                top = s_ref[t].to(torch.float64).sort(descending=True).values
                m = float(top[k - 1] - top[k])
                e["margin"] = m
                margins.append(m)
                e["scores_bitwise"] = bool(torch.equal(s_ref[t], s_here[t]))
            experts.append(e)
        f = {"phase": row["phase"], "module": row["module"], "op": None, "kind": row["kind"],
             "name": row["name"], "step": row["step"], "key": row["key"], "idx": row["idx"],
             "cause": None, "root_cause": False, "max_abs": None, "bound": None,
             "bound_ratio": None, "tokens": tokens[:MAX_LISTED], "n_tokens": len(tokens),
             "top_k": k, "experts": experts, "scores": score_key,
             "margin": max(margins) if margins else None}
        after = first_divergence is not None and first_divergence.get("key") != row["key"]
        f = describe(row, f, flip="consequence" if after else "root")
        if after:
            f["root"] = {"key": first_divergence.get("key"), "module": first_divergence.get("module"),
                         "cause": first_divergence.get("cause")}
            f["detail"] = (f"{len(tokens)} token(s) routed to other experts; the reference's top-{k} "
                           f"margin there is at most {f['margin']:.3g} (router scores), and the "
                           f"router's input already differed from {f['root']['module']} "
                           f"({f['root']['cause']}) on: a consequence, not the router's fault"
                           if f["margin"] is not None else
                           f"{len(tokens)} token(s) routed to other experts after the first "
                           f"divergence at {f['root']['module']}: a consequence")
        else:
            f["detail"] = (f"{len(tokens)} token(s) routed to other experts although no earlier "
                           "record differed: not a rounding consequence")
        out.append(f)
    return out


def _hash_only(row: dict, first_divergence: dict | None) -> dict:
    f = {"phase": row["phase"], "module": row["module"], "op": None, "kind": row["kind"],
         "name": row["name"], "step": row["step"], "key": row["key"], "idx": row["idx"],
         "cause": None, "root_cause": False, "max_abs": None, "bound": None,
         "bound_ratio": None, "tokens": None, "experts": None, "margin": None,
         "detail": "the expert choice differs (hash capture: which tokens is not recorded; "
                   "rerun with --capture full for tokens, experts and margins)"}
    after = first_divergence is not None and first_divergence.get("key") != row["key"]
    f = describe(row, f, flip="consequence" if after else "root")
    if after:
        f["root"] = {"key": first_divergence.get("key"), "module": first_divergence.get("module"),
                     "cause": first_divergence.get("cause")}
    return f


def relabel_after(findings: list[dict], idxs: list[int], flips: list[dict], dd=None) -> None:
    """A finding after a router flip (idxs: each finding's record index, execution order)
    inherits the flip: a token that ran other experts is beyond any rounding bound by
    construction - on the rows the flip can reach. A forward finding of the flip's own step whose
    other token rows are beyond the bound it was judged with stays what its evidence says
    (diff/flip_rows.py: a real mistake after the flip moves every row); where the rows are not told,
    the flip's finding says where to look first."""
    real = [f for f in flips if f["cause"] == "router-flip"]
    if not real:
        return
    first = min(real, key=lambda f: f["idx"])
    fl = by_idx = None
    for f, i in zip(findings, idxs):
        if i > first["idx"] and settle(f, after_flip=first["key"]).rule == "after a router flip":
            if dd is not None:
                from tpdiag.diff import flip_rows

                if fl is None:
                    fl, by_idx = flip_rows.flips_of(dd), {r["idx"]: r for r in dd.rows}
                row = by_idx.get(i)
                got = flip_rows.confined(dd, row, fl)
                if got is not None:
                    f["flip_rows"] = row["flip_rows"] = got  # the row's: the gate's re-diff reads it (flip_check.py)
                    if got["confined"] is False:
                        settle(f, after_flip=None)  # the other rows are no flip's: judged as before
                        continue
                    if got["confined"] is None:
                        settle(f, flip_untold=(
                            f"after the router flip at {first['key']}, beyond its bound on {got['rows_left']} token "
                            f"rows the flip did not flip (ratio {got['ratio']:.3g}), and no batch record says which "
                            "rows an op mixing a sequence's tokens carried the flip into: neither the flip's "
                            "consequence nor a bug is shown"))
                        f.update(root_cause=False, after=first["key"])
                        continue
            f.update(root_cause=False, after=first["key"])
