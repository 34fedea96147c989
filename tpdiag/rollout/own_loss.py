"""The trainer's own logprobs: a py: Target's `loss` at each generated token, judged in float64.

Every configuration takes each token's logprob with tpdiag's function (runner/losses, or
--logprob's recipe) - the numbers an engine reports, whatever the user's trainer computes. A
trainer that takes them in its own `Target.loss` (a label shifted twice, a log-softmax over the
wrong dimension, a temperature the engine did not sample at) computes other numbers, and no
configuration shows it: the run read `reproduced` and `rounding` while the trainer's policy ratio
was off by nats. Here the user's loss runs on one TP=1 configuration's logits rows exactly as the
model returned them (the configuration's flags and attention; its logprobs are checked to be the
configuration's bit for bit), with aligned labels as tpdiag passes them and ONE generated token
labelled, every other -100. A token-mean, sequence-mean or summed NLL of one token is minus that
token's logprob bit for bit (a sum of zeros and one term, divided by one), so -loss is the
trainer's logprob as its own code takes it - the shifts and masks inside the loss included. A
float64 log-softmax of the same rows at the run's temperature judges it: within the rounding
bound of a float32 log-softmax of the rows (and of a 16-bit one where the logits are 16-bit:
bounds.logprob_bound with no logits difference) it is rounding; beyond it the loss computes
another function of the logits - a BUG in Target.loss, which no kernel setting closes - unless
the loss adds a term that does not depend on the label (a z-loss, an entropy bonus) and the Target
says so (Target.loss_label_free): a token beyond its bound is labelled otherwise, and an offset from
the float64 log-softmax that no label moves is that term, not the logprob's (rollout/label_free.py).
Undeclared, such an offset stays a BUG: a normaliser off by a per-row constant (a temperature in the
logsumexp alone, columns past the vocabulary) moves with no label either, and only the user knows
which of the two a loss holds.
"""
from __future__ import annotations

import math

# generated tokens checked (in file order): one loss call on the sequence's whole rows each
MAX_TOKENS = 128


def applies(target) -> bool:
    """A py: Target with a loss of its own (hf: models and the presets take tpdiag's default)."""
    return getattr(target, "loss", None) is not None


def choose(cfgs, results: dict):
    """The configuration whose rows the loss reads: the first TP=1 one that ran, stock kernels
    first (the loss runs under the configuration's fixes: an F.cross_entropy in it is then
    invariant-vocab-softmax's), then prefill (a decode configuration has no rows for the prompt
    unless the engine gave its logprobs)."""
    ok = [c for c in cfgs if c.tp == 1 and results.get(c.rollout_name(), {}).get("status") == "ok"]
    return min(ok, key=lambda c: (c.fix != "none", c.mode != "prefill", ok.index(c))) if ok else None


def check(rc, cfgs, results: dict, trainer: dict, seqs, target, model, groups: int) -> dict | None:
    """None where there is no loss of the user's; {'skipped': why} where it could not run; else the
    finding: {'function', 'configuration', 'tokens', 'bug', 'ratio', 'max_abs_float64',
    'same_bits' (tokens where -loss is tpdiag's logprob bit for bit), 'max_abs_tpdiag', 'engine'
    (-loss against the engine), 'tpdiag' (tpdiag's numbers against the engine, the same tokens),
    'first' (the token furthest beyond its bound), 'line'}."""
    if not applies(target):
        return None
    fn = _name(target.loss)
    cfg = choose(cfgs, results)
    if cfg is None:
        return {"function": fn, "skipped": "no TP=1 configuration ran (its logits rows are what the loss reads, in this "
                                           "process): add 1 to --tp"}
    from tpdiag.rollout.compute import logprobs

    temp = _temperature(rc)
    rows = _Rows(seqs, target, temp)
    try:
        got = logprobs(cfg, target, model, seqs, tree_groups=groups, sampling=rc.sampling,
                       max_cache_len=rc.max_cache_len, max_new_tokens=rc.max_new_tokens, recipe=rc.recipe,
                       on_rows=rows)
    except Exception as e:  # noqa: BLE001 - the user's loss raising is reported, not a crash of the run
        return {"function": fn, "configuration": cfg.rollout_name(),
                "skipped": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}
    from tpdiag.rollout.metrics import same_bits

    mine = trainer[cfg.rollout_name()]
    same_rows = same_bits(seqs, got, mine)  # where the engine gave numbers (decode's prompt rows are NaN)
    return _verdict(fn, cfg.rollout_name(), rows.out, seqs, mine, temp, same_rows,
                    bool(getattr(target, "loss_label_free", False)))


def _bound(z, own, ref: float, temp: float) -> float:
    """The rounding bound of -loss (own, a 0-d tensor) against the float64 logprob ref of row z at
    temperature temp: a float32 log-softmax's, and a 16-bit one's where the logits are 16-bit."""
    import torch

    from tpdiag.diff.bounds import logprob_bound

    # a column the model masks to -inf is an exact 0 in the softmax: logprob_bound leaves it out
    sixteen = z.dtype in (torch.bfloat16, torch.float16)
    recipe = {"trainer_temperature": temp, "logprob": "model-dtype" if sixteen else "log-softmax",
              "temperature_in": "model" if sixteen else "float32"}
    own_lp = own.float() if own.dtype == torch.float64 else own
    ref = torch.tensor([ref], dtype=torch.float32, device=z.device)
    return float(logprob_bound(z[None], z[None], own_lp.reshape(1), ref, recipe)[0])


class _Rows:
    """compute.logprobs' on_rows hook: the user's loss at each generated token of a sequence, with
    the float64 log-softmax and the rounding bound of the same rows."""

    def __init__(self, seqs, target, temp: float):
        self.seqs, self.target, self.temp, self.out = seqs, target, temp, []

    def __call__(self, i: int, rows) -> None:
        import torch

        from tpdiag.rollout import label_free

        s = self.seqs[i]
        left = MAX_TOKENS - len(self.out)
        if left <= 0:
            return
        p, ids = s.prompt_len, s.input_ids
        decode_rows = bool(torch.isnan(rows[:p - 1].float()).any()) if p > 1 else False
        # a decode configuration's prompt rows are NaN (no prompt logprobs): the generated rows alone
        lo = p - 1 if decode_rows else 0
        mine = rows[lo:]
        n = mine.shape[0]
        vocab = self.target.vocab_size
        for j in range(p - 1, min(len(ids) - 1, p - 1 + left)):
            z = rows[j, :vocab]

            def minus_loss(token, at=j - lo):
                labels = torch.full((1, n), -100, dtype=torch.long, device=rows.device)
                labels[0, at] = token
                return -self.target.loss(mine[None], labels).detach()

            def bound_of(own, ref: float, z=z) -> float:
                return _bound(z, own, ref, self.temp)

            lsm64 = torch.log_softmax(z.double() / self.temp, -1)
            tok = ids[j + 1]
            own, ref = minus_loss(tok), float(lsm64[tok])
            bound = bound_of(own, ref)
            # a copy of the row (not a view holding the sequence's whole rows) and -loss's tensor: another
            # temperature's fit (rollout/own_temperature.py), dropped after it
            o = {"seq": i, "position": j + 1, "token": tok, "own": float(own), "float64": ref, "bound": bound,
                 "_z": z.detach().clone(), "_own_t": own}
            if not abs(float(own) - ref) <= bound:
                # beyond as a logprob: a term of the loss that does not depend on the label, or a bug
                o["relabel"] = label_free.judge(minus_loss, lsm64, tok, own, bound, bound_of)
            self.out.append(o)


def _verdict(fn: str, label: str, out: list, seqs, mine: list, temp: float, same_rows: bool,
             declared: bool = False) -> dict:
    toks = []
    for o in out:
        s = seqs[o["seq"]]
        o["engine"] = float(s.logprobs[o["position"] - s.prompt_len])
        o["tpdiag"] = float(mine[o["seq"]][o["position"] - 1])
        d = abs(o["own"] - o["float64"])
        o["ratio"] = d / o["bound"] if math.isfinite(d) else math.inf
        # an offset no label moves is a term of the loss only where the Target says it has one: a
        # per-row normaliser error is such an offset too (Target.loss_label_free)
        o["label_free"] = declared and bool(o.get("relabel", {}).get("label_free"))
        if o["label_free"]:  # -loss is the logprob plus a term no label moves: judged by how labels move it
            o["ratio"] = o["relabel"]["ratio"]
        toks.append(o)
    if not toks:
        return {"function": fn, "configuration": label, "skipped": "no generated token to check"}
    beyond = [o for o in toks if not o["ratio"] <= 1]  # NaN/Inf: beyond
    from tpdiag.rollout import own_temperature

    # every token the log-softmax at another temperature: which, and whether it is the engine's
    tfit = own_temperature.fit(toks, temp, _bound) if beyond and not any(o["label_free"] for o in toks) else None
    for o in toks:
        o.pop("_z", None)
        o.pop("_own_t", None)
    if tfit and tfit["engine"]:  # the loss is the engine's function: the run's temperature is off, not the loss
        beyond = []
    worst = max(toks, key=lambda o: o["ratio"] if not math.isnan(o["ratio"]) else math.inf)
    same = sum(1 for o in toks if _bits(o["own"]) == _bits(o["tpdiag"]))
    free = [o for o in toks if o["label_free"]]
    # -loss carries the label-free term there: its logprob term's own bits are not seen
    plain = [o for o in toks if not o["label_free"]]
    res = {"function": fn, "configuration": label, "tokens": len(toks), "sequences": len({o["seq"] for o in toks}),
           "temperature": temp, "rows_are_the_configurations": same_rows, "bug": bool(beyond),
           "beyond": len(beyond), "ratio": worst["ratio"],
           "max_abs_float64": max(abs(o["own"] - o["float64"]) for o in toks),
           "same_bits": same, "max_abs_tpdiag": max(abs(o["own"] - o["tpdiag"]) for o in toks),
           "label_free": len(free), "label_free_max": max((abs(o["relabel"]["term"]) for o in free), default=0.0),
           "label_free_declared": declared,
           "engine": _against(plain, "own"), "tpdiag": _against(plain, "tpdiag"), "temperature_fit": tfit,
           "first": {**worst, "line": seqs[worst["seq"]].where},
           # per token: seq, position (into input_ids), token, own (-loss), float64, bound, engine, tpdiag, ratio
           "checked": toks}
    res["line"] = _line(res)
    return res


def skipped_line(own: dict) -> str:
    return (f"your Target.loss ({own['function']}) was not run as the trainer's logprob, so the configurations' numbers "
            f"are tpdiag's log-softmax, not necessarily your trainer's: {own['skipped']}")


def _against(toks: list, key: str) -> dict:
    d = [o["engine"] - o[key] for o in toks]
    fin = [x for x in d if math.isfinite(x)]
    return {"tokens": len(d), "exact_tokens": sum(1 for o in toks if _bits(o["engine"]) == _bits(o[key])),
            "token_mult_prob_error": (math.fsum(math.exp(abs(x)) for x in fin) / len(fin)) if fin else math.nan,
            "max_abs": max((abs(x) for x in fin), default=math.nan), "non_finite": len(d) - len(fin)}


def _line(r: dict) -> str:
    w, t = r["first"], r["temperature"]
    at = f" / {t:g}" if t != 1.0 else ""
    own, eng, tp = r["engine"], r["tpdiag"], r["configuration"]
    said = (f"your Target.loss ({r['function']}) as the trainer's logprob, -loss with one generated token labelled, "
            f"on {tp}'s logits rows ({r['tokens']} tokens of {r['sequences']} sequence{'s' if r['sequences'] != 1 else ''}"
            + ("" if r["rows_are_the_configurations"] else
               "; recomputed here they gave other logprobs than that configuration's: the same function, other bits")
            + ")")
    vs = (f"against the engine token_mult_prob_error {own['token_mult_prob_error']:.7f}, {own['exact_tokens']}/"
          f"{own['tokens']} exact (tpdiag's log-softmax of the same rows: {eng['token_mult_prob_error']:.7f}, "
          f"{eng['exact_tokens']}/{eng['tokens']})")
    from tpdiag.rollout import own_temperature

    if r["temperature_fit"] and not r["bug"]:
        return own_temperature.words(r, said, vs)
    if r["bug"]:
        ratio = "NaN/Inf" if not math.isfinite(w["ratio"]) else f"{w['ratio']:.3g}x beyond rounding"
        return (f"BUG in Target.loss: {said} is not the tokens' log-softmax: at {w['line']} position {w['position']} "
                f"(token {w['token']}) it is {w['own']:.6g} where the float64 log_softmax(logits{at}) of the same rows "
                f"is {w['float64']:.6g} and the engine's {w['engine']:.6g} - {ratio} ({r['beyond']} of {r['tokens']} "
                f"tokens beyond) - another function of the logits, not rounding{_not_label_free(w, r)}; {vs}. The "
                "configurations above take "
                "tpdiag's log-softmax, not this: fix the loss (a label shifted twice, a log-softmax over another "
                "dimension than the vocabulary, a temperature the engine did not sample at"
                + (", the temperature --trainer-temperature names" if t != 1.0 else "") + ")"
                + (f"; {own_temperature.words(r, 'it', vs)}, nor the engine's" if r["temperature_fit"] else ""))
    if r["label_free"]:
        rest = r["tokens"] - r["label_free"]
        return (f"{said} is the tokens' log-softmax plus a term that does not depend on the label (a z-loss, an "
                f"entropy bonus: not part of the logprob; up to {r['label_free_max']:.3g} nats at {r['label_free']} of "
                f"{r['tokens']} tokens): labelled otherwise (the row's least and most likely tokens), -loss moves as "
                f"the float64 log_softmax(logits{at}) does, within rounding (up to {r['ratio']:.2g} of its bound); "
                "the bits of its logprob term are not seen" + (f"; at the other {rest}: {vs}" if rest else ""))
    if r["same_bits"] == r["tokens"]:
        return (f"{said} gives tpdiag's logprobs bit for bit at every token checked: the configurations' numbers are "
                "your trainer's")
    return (f"{said} is the tokens' log-softmax up to rounding (up to {r['ratio']:.2g} of its bound from the float64 "
            f"log_softmax(logits{at}); {r['same_bits']}/{r['tokens']} tokens tpdiag's bits, up to "
            f"{r['max_abs_tpdiag']:.3g} nats from them): {vs}")


def _not_label_free(w: dict, r: dict) -> str:
    """Why the token's gap is not a term of the loss that no label moves (a z-loss), where tried."""
    tried = w.get("relabel")
    if not tried:
        return ""
    if tried["label_free"] and not r["label_free_declared"]:
        return (f"; labelled otherwise, -loss minus the float64 log-softmax stays at {tried['term']:.3g} nats (within "
                "rounding): a term that does not depend on the label - a z-loss or an entropy bonus your loss adds on "
                "purpose, or a normaliser off by a per-row constant (a temperature in the logsumexp alone, columns "
                "past the vocabulary), which no label moves either. A loss with such a term says so: "
                "Target(loss_label_free=True)")
    t = max(tried["relabelled"], key=lambda x: x["ratio"] if not math.isnan(x["ratio"]) else math.inf)
    ratio = "NaN/Inf" if not math.isfinite(t["ratio"]) else f"{t['ratio']:.3g}x its rounding"
    return (f", nor a term that does not depend on the label (a z-loss, an entropy bonus): labelled {t['token']} "
            f"instead, -loss minus the float64 log-softmax moves by {t['moved']:.3g} nats ({ratio})")


def _temperature(rc) -> float:
    """The run's temperature: the trainer's (--trainer-temperature), else 1 (--sampling, the other
    way to name one, is for hf: models, which have no loss of the user's)."""
    return float(rc.recipe.temperature) if rc.recipe is not None else 1.0


def _bits(x: float) -> float:
    """A float32 logprob's value as a hashable exact key (-0.0 and 0.0 alike, NaN never equal)."""
    return x if x == x else object()


def _name(fn) -> str:
    """Where the loss sits: FILE:LINE (relative to the working directory) and its name."""
    import os

    code = getattr(fn, "__code__", None) or getattr(getattr(fn, "__call__", None), "__code__", None)
    name = getattr(fn, "__qualname__", type(fn).__qualname__)
    if code is None:
        return name
    path = os.path.relpath(code.co_filename) if not os.path.relpath(code.co_filename).startswith("..") else code.co_filename
    return f"{path}:{code.co_firstlineno} {name}"


def lead(own: dict | None) -> str:
    """The what-to-do line's first words where the loss is a bug ('' otherwise)."""
    if not own or not own.get("bug"):
        return ""
    w = own["first"]
    return (f"first: fix your Target.loss ({own['function']}) - its logprob at {w['line']} position {w['position']} is "
            f"{w['own']:.6g} where the float64 log-softmax is {w['float64']:.6g} (the Target.loss note above): the "
            "trainer's policy ratio is built on it, so no setting below closes that gap; ")


def reproduced_words(reference: str, m: dict) -> str:
    """The `loss` case: tpdiag's log-softmax is the engine's, the user's loss is not."""
    return (f"tpdiag's log-softmax of the trainer's configuration ({reference}) computes the engine's logprobs bit for "
            f"bit ({m['exact_tokens']}/{m['tokens']} tokens exact): the model and its settings are the engine's, your "
            "loss's logprobs are not.")


def gap(own: dict) -> str:
    """The trainer's gap in NeMo RL's terms, from the user's own logprobs where the loss is a bug."""
    e = own["engine"]
    return (f"Your trainer's own logprobs read token_mult_prob_error {e['token_mult_prob_error']:.7f} against the engine "
            f"({e['exact_tokens']}/{e['tokens']} exact): the gap is the Target.loss bug named above, not rounding, "
            f"whatever NeMo RL's 1.05 says")


def rounding_words(own: dict | None) -> str:
    """Where the user's loss is right but not tpdiag's bits: its own gap to the engine, as rounding."""
    if own and not own.get("bug") and (own.get("temperature_fit") or {}).get("engine"):
        e = own["engine"]
        return (f". Your Target.loss's own logprobs read token_mult_prob_error {e['token_mult_prob_error']:.7f} against "
                f"the engine ({e['exact_tokens']}/{e['tokens']} exact): the gap above is the run's temperature, not "
                "your trainer's")
    if not own or own.get("bug") or "same_bits" not in own or own["same_bits"] == own["tokens"]:
        return ""
    if own.get("label_free"):
        return (f". Your Target.loss adds a term that does not depend on the label (up to {own['label_free_max']:.3g} "
                "nats at a token: a z-loss, an entropy bonus), and its logprob term is the tokens' log-softmax up to "
                "rounding (the Target.loss note above)")
    e = own["engine"]
    return (f". Your Target.loss's own logprobs are not these bits ({own['same_bits']}/{own['tokens']} tokens, up to "
            f"{own['max_abs_tpdiag']:.3g} nats from them; against the engine token_mult_prob_error "
            f"{e['token_mult_prob_error']:.7f}, {e['exact_tokens']}/{e['tokens']} exact): rounding of the same "
            "log-softmax (within its float64 bound: the Target.loss note above), harmless unless you need bitwise; to "
            "match bitwise, take the log-softmax of the float32 logits as the engine does")
