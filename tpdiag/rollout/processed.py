"""Did the engine report processed logprobs - renormalised after top-k / top-p filtering, or
scaled by a sampling temperature - instead of the model's raw ones?

The trainer's logits rows (its first configuration) say what each processing would have given:
- renormalised over a kept set S: engine = trainer - log(mass of S), so exp(-diff) is exactly a
  prefix sum of the trainer's sorted probabilities (the top-k) - one k for all tokens is top-k,
  varying ks with the kept mass always >= some p is top-p;
- a reported top-k whose probabilities sum to ~1 where the trainer puts less mass on them;
- temperature T: engine = log_softmax(logits / T)[token] for one T;
- failing a fit, engine logprobs systematically above the trainer's.
"""
from __future__ import annotations

import math

# every temperature an RL run samples at that we have seen: 0.05 .. 2 by 0.05, 2.1 .. 4 by 0.1,
# 4.5 .. 10 by 0.5 (a T between grid points still fits far better than raw, named as the nearest)
TEMPERATURES = tuple(sorted({round(0.05 * i, 2) for i in range(1, 41)} | {round(2 + 0.1 * i, 1) for i in range(1, 21)}
                            | {round(4 + 0.5 * i, 1) for i in range(1, 13)}))
# generate()'s processing, reproduced on the trainer's side (tpdiag.rollout.sampling)
SAMPLING_HINT = ("generate()'s output_scores: --sampling temperature=T,top_k=K,top_p=P,min_p=M,"
                 "repetition_penalty=R with the engine's values, bit for bit")
# renormalisation fits when log(prefix mass) matches -diff this closely (nats)
FIT_TOL = 2e-3
# two logits count as tied (a top-k keeps both) this many roundings of the row apart: a tie the
# engine saw lies within one rounding of each side's logits of the trainer's
TIE_ROUNDINGS = 2
# the temperature analysis reads at most this many generated tokens (cost: |T| x tokens x vocab)
MAX_TEMP_TOKENS = 1024
# a top-k filter before top-p is recognised up to this K (the masses of the first K_MAX sorted
# tokens kept per token and temperature: float32, 1024 x |T| x K_MAX x 4 bytes = 37 MB at most)
K_MAX = 128


class Collector:
    """on_logits hook for the first configuration: per generated token the trainer's top-2
    margin, the token's rank, the prefix of sorted probabilities that renormalisation would
    match, the reported top-k's trainer mass, and log_softmax(logits / T) for each T."""

    def __init__(self, seqs):
        self.seqs = seqs
        self.stats: dict[tuple[int, int], dict] = {}
        self._temp_tokens = 0
        from tpdiag.rollout.shifted import Pairs

        self.shift = Pairs(seqs)  # a neighbouring token's logprob in the file (rollout/shifted.py)

    def __call__(self, i: int, rows) -> None:
        import torch

        self.shift(i, rows)
        s = self.seqs[i]
        p = s.prompt_len
        z = rows[p - 1:].double()  # rows[t - 1] predicts input_ids[t]
        toks = torch.tensor(s.input_ids[p:], device=z.device)
        lsm = torch.log_softmax(z, -1)
        top2 = lsm.topk(2, dim=-1).values
        own = lsm.gather(-1, toks[:, None])[:, 0]
        rank = (lsm > own[:, None]).sum(-1)
        eng = torch.tensor(s.logprobs, dtype=torch.float64, device=z.device)
        d = eng - own
        probs = lsm.exp().sort(-1, descending=True).values
        srt = probs.cumsum(-1).log()
        # the smallest k whose prefix mass m has log m closest to -diff
        k = (srt - (-d)[:, None]).abs().argmin(-1)
        fit = (srt.gather(-1, k[:, None])[:, 0] + d).abs()
        # where the k-th probability is tied with those before it (bf16 logits tie often), a top-K
        # that keeps every token tied with its K-th (transformers' TopKLogitsWarper) keeps k tokens for
        # any K in [k_lo, k]: the first index of that tie
        k_lo = (probs == probs.gather(-1, k[:, None])).int().argmax(-1)
        # the engine's ties are not the trainer's: its logits are the trainer's up to rounding (a
        # decode step's GEMMs against a prefill's), which breaks a tie by an ulp or two either way;
        # the first index whose logit is within that rounding of the k-th (k_near <= k_lo)
        zs = z.sort(-1, descending=True).values
        k_near = (zs <= zs.gather(-1, k[:, None]) + _tie_tolerance(z)).int().argmax(-1)
        temps = tfits = heads = None
        if self._temp_tokens < MAX_TEMP_TOKENS:
            temps, tfits, heads = _per_temperature(z, toks, eng, rank)
            kept = _top_k_kept(z)
            self._temp_tokens += len(toks)
        # the row's largest |logit| bounds what rounding the logits to bf16 (fp16) moves its log-softmax by
        # (rollout/low_precision.py)
        zmax = z.abs().amax(-1)
        for j in range(len(toks)):
            st = {"margin": float(top2[j, 0] - top2[j, 1]), "rank": int(rank[j]), "own": float(own[j]),
                  "zmax": float(zmax[j]),
                  "k": int(k[j]) + 1, "k_lo": int(k_lo[j]) + 1, "k_near": int(k_near[j]) + 1,
                  "fit": float(fit[j]), "diff": float(d[j])}
            if s.top is not None and s.top[j]:
                ids = torch.tensor([t for t, _ in s.top[j]], device=z.device)
                st["reported_mass"] = math.fsum(math.exp(lp) for _, lp in s.top[j])
                st["trainer_mass"] = float(lsm[j].exp()[ids].sum())
                st["reported_k"] = len(s.top[j])
            if temps is not None:
                st["temps"] = temps[j].tolist()
                st["temp_fits"] = tfits[j].tolist()
                st["temp_heads"] = heads[j]
                st["top_k_kept"] = kept[j]
            self.stats[(i, p + j)] = st


def judge(collector: Collector, vocab: int) -> dict:
    """{'detected': bool, 'kind': ..., 'explanation': ..., evidence}."""
    # a token --sampling's filters removed on the trainer's side (-inf) says nothing of processing
    st = [x for x in collector.stats.values() if math.isfinite(x["diff"])]
    if not st:
        return {"detected": False, "kind": None, "explanation": "no generated tokens"}
    d = [x["diff"] for x in st]
    n = len(d)
    mean_d = math.fsum(d) / n
    max_abs = max(abs(x) for x in d)
    ev = {"tokens": n, "mean_diff": mean_d,
          "engine_at_or_above_trainer": sum(1 for x in d if x >= -1e-6) / n}
    if max_abs < 1e-3:
        return {"detected": False, "kind": None, **ev,
                "explanation": f"the engine is within {max_abs:.2g} nats of the trainer's logits (float64 "
                               "log-softmax) everywhere: rounding-sized, not processing"}
    # 1. a reported top-k that sums to ~1 where the trainer's mass on it is clearly less
    rep = [x for x in st if "reported_mass" in x]
    if rep:
        rm = sorted(x["reported_mass"] for x in rep)[len(rep) // 2]
        tm = sorted(x["trainer_mass"] for x in rep)[len(rep) // 2]
        ks = sorted({x["reported_k"] for x in rep})
        ev.update(reported_top_mass_median=rm, trainer_mass_on_them_median=tm)
        if rm > 0.999 and tm < 0.99 and max(ks) < vocab:
            return {"detected": True, "kind": "renormalised", **ev, **_k_fit(st),
                    "explanation": f"the engine's reported top-{ks[-1]} sum to "
                                   f"{rm:.4f} per token (median) where the trainer puts {tm:.4f} on the same "
                                   "tokens - the engine renormalised after top-k/top-p filtering. Ask it "
                                   "for raw logprobs (vLLM: logprobs_mode=raw_logprobs) or recompute them"}
    # 2. renormalisation over a prefix of the trainer's sorted probabilities. A filter only raises,
    # so tokens lowered as far as the raised ones were raised are noise of that size, and with a
    # large vocabulary almost any small raise is some prefix's mass: among the tokens that moved
    # beyond the fit tolerance nearly all must be raised, and at least two must fit (one token,
    # raised 0.0038 by bf16 prefill-vs-decode rounding beside one lowered 0.0076 and 77 exact, read
    # "top-k=251" of a vocabulary of 256 on a raw rollout)
    moved = [x for x in st if x["diff"] > FIT_TOL]
    fits = [x for x in moved if x["fit"] <= FIT_TOL]
    higher = ev["engine_at_or_above_trainer"]
    lowered = sum(1 for x in d if x < -FIT_TOL)
    if (moved and len(fits) >= 0.9 * len(moved) and higher >= 0.95 and len(fits) >= 2
            and len(moved) >= 0.95 * (len(moved) + lowered)):
        kf = _k_fit(st)
        return {"detected": True, "kind": kf["fit_kind"], **ev, **kf,
                "explanation": f"{len(fits)} of {len(moved)} raised tokens are exactly "
                               f"the trainer's logprob minus log(mass of its {kf['fit_describe']}): the engine "
                               "renormalised after sampling filters. Ask it for raw logprobs (vLLM: "
                               "logprobs_mode=raw_logprobs; generate(): output_logits, not output_scores) or "
                               f"compare with the same filter applied ({SAMPLING_HINT})"}
    # 3. temperature alone, to rounding: log_softmax(logits / T) for one T on the grid
    temp = _temperature_fit(st)
    if temp is not None:
        ev.update(temperature_fit=temp["t"], temperature_fit_error=temp["err"], raw_error=temp["raw"])
        if temp["t"] != 1.0 and temp["err"] <= FIT_TOL:
            return _temperature_verdict(temp, ev)
    # 4. temperature, then a top-k / top-p filter renormalised (the order generate() and vLLM apply
    # them): for one T, every token the engine raised above log_softmax(logits / T) is exactly that
    # minus log(mass of a prefix of the sorted softmax(logits / T)) - the sort order is T's too.
    # Tried before an approximate temperature: a filter on top of T=0.7 is matched far better by
    # some plain T (0.55) than by raw logits, and naming that T would hide the filter
    tf = [x for x in st if "temp_fits" in x]
    if tf:
        best = _temperature_filter_fit(tf)
        if best is not None:
            t, n_fit, n_all = best
            ev.update(temperature_fit=t, filter_fit_tokens=n_fit)
            return {"detected": True, "kind": "temperature+filter", **ev,
                    "explanation": f"{n_fit} of {n_all} tokens are exactly log_softmax(logits / {t:g}) "
                                   "minus log(mass of a top-k/top-p prefix of softmax(logits / "
                                   f"{t:g})): the engine sampled at temperature {t:g} and renormalised "
                                   "after its sampling filters. Ask it for raw logprobs (vLLM: "
                                   f"logprobs_mode=raw_logprobs) or compare with the same processing ({SAMPLING_HINT})"}
    # 5. a temperature that fits far better than raw but not to rounding: a T between grid points,
    # or a trainer whose logits are not the engine's bits (another dtype) - named as the nearest
    if temp is not None and temp["t"] != 1.0 and temp["err"] < temp["raw"] / 10:
        return _temperature_verdict(temp, ev)
    # a filter moves most tokens, and only up: a few tokens off among exact ones (another token than
    # the engine's at some positions) are not a filter
    moved_any = [x for x in d if abs(x) > FIT_TOL]
    raised_share = sum(1 for x in moved_any if x > 0) / len(moved_any) if moved_any else 0.0
    if higher >= 0.95 and mean_d > 1e-3 and raised_share >= 0.95 and len(moved_any) >= 0.5 * n:
        return {"detected": True, "kind": "systematic", **ev,
                "explanation": f"engine logprobs are at or above the trainer's for {higher:.0%} of tokens "
                               f"(mean +{mean_d:.3g} nats): typical of logprobs renormalised after "
                               "top-k/top-p filtering, though no temperature and filter fits - as "
                               "when a penalty moved the logits of tokens already seen first, or min_p "
                               "cut the tail (generate()'s repetition_penalty and min_p: give the engine's "
                               f"settings, {SAMPLING_HINT}; vLLM's presence/frequency penalties are not "
                               "modelled) - or of another model than --model (a smaller vocabulary, other "
                               "weights: the file does not say which model made it)"}
    return {"detected": False, "kind": None, **ev,
            "explanation": "no sign of processing: differences go both ways and fit no filter or temperature"}


def read_on(verdict: dict, stats_from: str | None, modes) -> dict:
    """A `systematic` verdict read on a prefill configuration's rows while the run also decodes: a
    filter's edge and its ties are read on those rows, and a decoding engine's bf16 logits are not a
    prefill's bits - a near-tie its rounding made a tie is missed, and a temperature and top-k the
    engine ran read as no fit (a bf16 GLM-4's generate() at T=0.8, top_k=20: `systematic` against
    the prefill, `temperature+filter` against the decode; tests/test_rl_glm4_trial.py)."""
    if verdict.get("kind") != "systematic" or not stats_from or "-prefill-" not in stats_from or "decode" not in modes:
        return verdict
    return {**verdict, "explanation": verdict["explanation"] + (
        f"; read on {stats_from}'s logits rows, which are not a decoding engine's bits: where its ties or a filter's "
        "edge moved, no fit is found - --mode decode,prefill reads the decode's rows first")}


def _tie_tolerance(rows):
    """Per row, how far apart two logits the engine computed equal can be in the trainer's rows:
    TIE_ROUNDINGS roundings of the coarsest float grid that holds every value of the row (bf16
    logits upcast to float32 lie on bf16's), at the row's largest magnitude - a GEMM's rounding
    error scales with the row, not with each element (generate()'s bf16 decode against the same
    model's prefill: up to 1.06 such roundings apart, at logits near 0 too)."""
    import torch

    r = rows.float()
    r = torch.where(torch.isfinite(r), r, torch.zeros_like(r))  # a filtered -inf is no magnitude
    eps = torch.finfo(torch.float32).eps
    for dt in (torch.bfloat16, torch.float16):
        if torch.equal(r.to(dt).float(), r):
            eps = torch.finfo(dt).eps
            break
    return (TIE_ROUNDINGS * eps * r.abs().amax(-1, keepdim=True)).double()


def temperature_errors(st) -> list[float] | None:
    """Per temperature of TEMPERATURES, the mean |engine - log_softmax(logits / T)[token]| (nats)
    over the tokens with temperature rows; None without them."""
    tt = [x["temps"] for x in st if "temps" in x and math.isfinite(x["diff"])]
    if not tt:
        return None
    eng = [x["diff"] + x["temps"][TEMPERATURES.index(1.0)] for x in st if "temps" in x and math.isfinite(x["diff"])]
    return [math.fsum(abs(e - row[k]) for e, row in zip(eng, tt)) / len(tt) for k in range(len(TEMPERATURES))]


def _temperature_fit(st):
    """{'t', 'err', 'raw'}: the grid temperature whose log_softmax(logits / T) is nearest the
    engine's numbers (mean |error|, nats) and raw logits' error; None without temperature rows."""
    errs = temperature_errors(st)
    if errs is None:
        return None
    best = min(range(len(errs)), key=errs.__getitem__)
    return {"t": TEMPERATURES[best], "err": errs[best], "raw": errs[TEMPERATURES.index(1.0)]}


def _temperature_verdict(temp, ev) -> dict:
    return {"detected": True, "kind": "temperature", **ev,
            "explanation": f"the engine's numbers are log_softmax(logits / "
                           f"{temp['t']:g}) to {temp['err']:.2g} nats (raw: {temp['raw']:.2g}) - "
                           f"temperature-scaled. Compare with the same temperature and no filter: --sampling "
                           f"temperature={temp['t']:g},top_k=0 makes every trainer logprob log_softmax(float32 "
                           "logits / T), as generate()'s output_scores and a trainer that divides its float32 "
                           "logits compute it (top_k=0: none was seen here, and generate()'s default top_k=50 "
                           "applies where --sampling does not turn it off) - or ask for raw logprobs. A trainer "
                           "whose policy ratio takes these numbers must divide its logits by the same "
                           f"temperature: one that does not (log_softmax(logits), T=1) computes another "
                           f"distribution, a bug in its loss, not rounding; {flag_words(temp['t'])}"}


def flag_words(t: float) -> str:
    """The temperature line's last words: how to take the trainer's logprobs at the engine's T."""
    return f"--trainer-temperature {t:g} takes the trainer's logprobs at it"


def _per_temperature(z, toks, eng, rank):
    """Per token and temperature T: log_softmax(z / T)[token], the renormalisation fit at T -
    [error, k, mass before, mass through, diff]: how far the engine's logprob is from that minus log(the
    mass of the closest prefix of the sorted softmax(z / T) that holds the token: its first k
    tokens), and that prefix's mass without and with its last token (a top-p threshold lies
    between them) - and the masses of the first K_MAX prefixes (a top-k before top-p renormalises
    by one of them). Error inf where the engine is below log_softmax(z / T): a filter only raises."""
    import torch

    order = z.argsort(-1, descending=True)  # one order for every T > 0
    cols = torch.arange(z.shape[-1], device=z.device)
    holds = cols[None, :] >= rank[:, None]  # prefixes of k + 1 >= rank + 1 tokens hold the token
    temps, fits, heads = [], [], []
    for t in TEMPERATURES:
        lsm = torch.log_softmax(z / t, -1)
        own = lsm.gather(-1, toks[:, None])[:, 0]
        d = eng - own
        mass = lsm.gather(-1, order).exp().cumsum(-1).clamp(max=1.0)
        err = (mass.log() + d[:, None]).abs().masked_fill(~holds, float("inf"))
        e, k = err.min(-1)
        e = torch.where(d >= -FIT_TOL, e, torch.full_like(e, float("inf")))
        through = mass.gather(-1, k[:, None])[:, 0]
        before = torch.where(k > 0, mass.gather(-1, (k - 1).clamp(min=0)[:, None])[:, 0], torch.zeros_like(through))
        temps.append(own)
        fits.append(torch.stack([e, (k + 1).to(e.dtype), before, through, d], dim=-1))
        heads.append(mass[:, :K_MAX].float().cpu())
    return torch.stack(temps, dim=-1), torch.stack(fits, dim=1), torch.stack(heads, dim=1)


def _temperature_filter_fit(st):
    """(T, tokens that fit, tokens) for a T != 1 at which >= 90% of the tokens are
    log_softmax(logits / T) renormalised over a prefix of the sorted softmax(logits / T), the
    raised ones' prefixes one top-k and top-p filter, or None. Most fitting tokens win, then the T
    nearest 1. The filter's consistency is what tells this from noise: with a large vocabulary
    almost any small raise is some prefix's mass."""
    best = None
    for j, t in enumerate(TEMPERATURES):
        if t == 1.0:
            continue
        idx = [i for i, x in enumerate(st) if x["temp_fits"][j][0] <= FIT_TOL]
        raised = [i for i in idx if st[i]["temp_fits"][j][4] > FIT_TOL]
        if len(idx) < 0.9 * len(st) or len(raised) < 2:
            continue
        if not _one_filter([st[i]["temp_fits"][j] for i in raised],
                           [st[i].get("temp_heads") for i in raised], j,
                           [st[i].get("top_k_kept") for i in raised]):
            continue
        key = (len(idx), -abs(math.log(t)))
        if best is None or key > best[0]:
            best = (key, t, len(idx))
    return None if best is None else (best[1], best[2], len(st))


def _top_k_kept(z):
    """Per token, the tokens a top-K keeps for K = 1..K_MAX (int tensor [tokens, K_MAX]): K and every
    token tied with the K-th largest logit, as transformers' TopKLogitsWarper keeps them (it removes
    `scores < topk(scores, K)[..., -1]`). One count for every temperature: dividing by T > 0 keeps
    the order and the exact ties."""
    import torch

    asc = z.sort(-1).values.contiguous()
    kth = asc.flip(-1)[:, :min(K_MAX, z.shape[-1])].contiguous()  # the K-th largest, K = 1..
    # how many are >= the K-th: all but those below it ([tokens, K_MAX], never [tokens, K_MAX, vocab])
    return (z.shape[-1] - torch.searchsorted(asc, kth, side="left")).cpu()


def _one_filter(fits, heads, j, kept=None) -> bool:
    """Do the raised tokens' kept prefixes [error, k, mass before, mass through, diff] come from one
    top-k K and one top-p p? top-p keeps the smallest prefix whose mass reaches p, measured after
    top-k renormalised the K kept (transformers' TopPLogitsWarper after TopKLogitsWarper; vLLM's
    top-k/top-p sampler): a token whose prefix k < K has before < p * M_K <= through, M_K the
    mass of the first K; one whose k = K only before < p * M_K (top-k cut it first). K runs from
    the largest prefix to K_MAX, and without a top-k (M = 1, K the largest prefix). A top-K keeps the
    tokens tied with its K-th too (`kept`: per token, how many for each K), so M_K is the mass of
    that many and k = K means k reaches them: with bf16 logits ties are common (a Gemma2 saved in
    bf16, T=0.9, top_k=40, top_p=0.95: one row kept 41, and no one K fitted every row)."""
    import torch

    f = torch.tensor(fits, dtype=torch.float64)
    k, before, through = f[:, 1].long(), f[:, 2], f[:, 3]
    kmax = int(k.max())

    def consistent(m, K):
        cut = k < K
        lo = float((before / m).max())
        hi = float((through[cut] / m[cut]).min()) if bool(cut.any()) else 1.0
        return lo < hi + FIT_TOL

    if consistent(torch.ones_like(before), kmax):
        return True
    if any(h is None for h in heads):
        return False
    cols = torch.stack([h[j] for h in heads]).double()  # [raised tokens, K_MAX]: mass of the first K
    n = min(K_MAX, cols.shape[1])
    if any(c is None for c in (kept or [None])):
        return any(consistent(cols[:, K - 1], K) for K in range(kmax, n + 1))
    kept = torch.stack(list(kept))[:, :n].long()  # [raised tokens, K]: kept by a top-K, ties included
    for K in range(1, n + 1):
        c = kept[:, K - 1]
        if bool((c > n).any()) or bool((k > c).any()):  # ties past the masses held, or a prefix beyond it
            continue
        if consistent(cols.gather(1, (c - 1)[:, None])[:, 0], c):
            return True
    return False


def _k_fit(st) -> dict:
    moved = [x for x in st if x["diff"] > FIT_TOL and x["fit"] <= FIT_TOL]
    ks = sorted({x["k"] for x in moved})
    if len(ks) == 1:
        return {"fit_kind": "top-k", "fit_k": ks[0], "fit_describe": f"top {ks[0]} tokens (top-k={ks[0]})"}
    if not moved:
        return {"fit_kind": "renormalised", "fit_describe": "kept tokens"}
    # one K for every token once the ties at the K-th probability are kept: top-k, not top-p (read
    # as top-p ~ 0.39 for generate()'s default top_k=50 on a bf16 model)
    lo, hi = max(x.get("k_lo", x["k"]) for x in moved), min(x["k"] for x in moved)
    if lo <= hi:
        k = lo if lo == hi else f"{lo}..{hi}"
        return {"fit_kind": "top-k", "fit_k": lo, "fit_k_max": hi,
                "fit_describe": (f"top {k} tokens, with every token tied with the last kept (top-k={k}, ties "
                                 "kept as transformers' top-k keeps them)")}
    # the same with the ties the engine saw but the trainer's rounding broke (a bf16 trainer's
    # prefill against generate()'s decode: top_k=50 read "top-p ~ 0.236" with the prefill first)
    lo = max(x.get("k_near", x["k"]) for x in moved)
    if lo <= hi:
        k = lo if lo == hi else f"{lo}..{hi}"
        return {"fit_kind": "top-k", "fit_k": lo, "fit_k_max": hi,
                "fit_describe": (f"top {k} tokens, with every token tied with the last kept (top-k={k}, ties "
                                 "kept as transformers' top-k keeps them; ties read on the engine's logits, "
                                 "which differ from the trainer's by rounding)")}
    p = min(math.exp(-x["diff"]) for x in moved)
    return {"fit_kind": "top-p", "fit_p": p, "fit_ks": ks[:8],
            "fit_describe": f"smallest prefix holding >= {p:.3g} of the mass (top-p ~ {p:.3g})"}
