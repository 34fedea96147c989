"""Did whatever wrote the file run a left-padded batch without its mask, or with positions from the pad?

The classic padding bug of an RL trainer (or engine): it scores generate()'s left-padded rows with
`model(ids)` - the pads attended, and transformers numbers positions 0..L-1 from the pad - or with
`model(ids, attention_mask=mask)` and no position_ids (the pads masked, positions still from the
pad). Every token of a padded sequence moves: attending pads is another function, and RoPE at
another position is another rotation, so no kernel setting reproduces the file, and the gap
(a token_mult_prob_error near 1.02 for shifted positions in a new user's trial) read as "within
NeMo RL's 1.05 for a healthy run". Here the model runs the file's sequences left-padded as such a
trainer batches them, correctly and in each wrong way, in the same call shapes; a wrong way whose
numbers are the file's (a tenth of the correct way's gap, or less, on the padded sequences) names
the bug. hf: models only: they take an attention mask and position ids (runner/decode.is_hf).
"""
from __future__ import annotations

# variant: (attention mask passed, positions from each row's first real token)
VARIANTS = {
    "unmasked": (False, False),    # model(ids): pads attended, positions from the pad
    "positions": (True, False),    # model(ids, attention_mask=mask): positions from the pad
    "unmasked_only": (False, True),  # position_ids given, no mask: pads attended
}
WORDS = {
    "unmasked": "ran the left padding unmasked (no attention_mask: the pad tokens attended) and with "
                "positions counted from the pad (0..L-1 from the row's first pad, not its first real token)",
    "positions": "ran the left padding masked, with positions counted from the pad (no "
                 "position_ids: transformers numbers 0..L-1 from the row's first pad, not its first real token)",
    "unmasked_only": "ran the left padding unmasked (no attention_mask: the pad tokens attended), positions right",
}
# how the batch was laid out: each whole sequence left-padded to the longest, or the prompts
# left-padded to the longest prompt and the generated tokens after them (generate()'s `sequences`)
LAYOUTS = ("whole", "prompt")
# a wrong way fits where its median |diff| to the file is this fraction of the correct way's, or less
RATIO = 0.1
# ... and is a bug only where, with the model in float64, it is another function than the right way
# (nats; rollout/mode_gap.py's yardstick): RoPE reads relative positions, so with the mask passed,
# positions counted from the pad shift every row by a constant and compute the same function -
# 1e-7 apart in float64 (transformers takes RoPE's cos/sin in float32) - while attended pads and a
# learned absolute position table (GPT-2) move tokens by 1e-2 and more
TOL = 1e-3
# parameters above which the float64 copy is not made (8 bytes each, beside the model)
MAX_PARAMS = 2_000_000_000


# the whole file as one batch is tried where it has at most this many sequences (one call of them
# all: a large rollout's would not fit where its micro-batches do)
WHOLE_FILE = 16


def _batches(seqs, sizes):
    n = len(seqs)
    for m in sorted({min(s, n) for s in sizes} | ({n} if n <= WHOLE_FILE else set())):
        if m > 1:
            yield m, [list(range(i, min(i + m, n))) for i in range(0, n, m)]


def _layout(group, layout: str, pad: int):
    """(ids, mask, offsets): the group's rows left-padded; offsets[r] is where row r's first token is."""
    import torch

    if layout == "whole":
        width = max(len(s.input_ids) for s in group)
        offs = [width - len(s.input_ids) for s in group]
    else:
        plen = max(s.prompt_len for s in group)
        offs = [plen - s.prompt_len for s in group]
        width = max(o + len(s.input_ids) for o, s in zip(offs, group))
    ids = torch.full((len(group), width), pad, dtype=torch.long)
    mask = torch.zeros((len(group), width), dtype=torch.long)
    for r, (o, s) in enumerate(zip(offs, group)):
        ids[r, o:o + len(s.input_ids)] = torch.tensor(s.input_ids)
        mask[r, o:o + len(s.input_ids)] = 1
    return ids, mask, offs


def _generated(model, group, ids, mask, offs, masked: bool, own_positions: bool) -> list:
    """Per row, the float32 log-softmax logprob of each generated token (the engine's and trainers' way)."""
    import torch

    dev = next(model.parameters()).device
    kw = {"use_cache": False}
    if masked:
        kw["attention_mask"] = mask.to(dev)
    if own_positions:
        kw["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0).to(dev)
    logits = model(input_ids=ids.to(dev), **kw).logits
    out = []
    for r, (o, s) in enumerate(zip(offs, group)):
        lp = (logits[r] if logits.dtype == torch.float64 else logits[r].float()).log_softmax(-1)
        out.append([float(lp[o + t - 1, s.input_ids[t]]) for t in range(s.prompt_len, len(s.input_ids))])
    return out


def check(seqs, model, sizes) -> dict | None:
    """None, or {'variant', 'layout', 'batch', 'tokens', 'exact_tokens', 'median_abs',
    'correct_median_abs', 'float64_max_abs', 'bug' (True, False: the same function, None: not
    judged), 'line'} for the wrong way that gives the file's numbers (the closest)."""
    try:
        return _check(seqs, model, sizes)
    except (RuntimeError, TypeError, ValueError, NotImplementedError):
        # a lead where nothing reproduces, never a failed report: a forward that refuses position_ids
        # or runs out of memory leaves the other notes as they were
        return None


def _check(seqs, model, sizes) -> dict | None:
    import math

    import torch

    from tpdiag.rollout.compute import pad_id
    from tpdiag.runner.decode import is_hf

    if not is_hf(model):
        return None
    pad = pad_id(model)
    best = None
    with torch.no_grad():
        for m, groups in _batches(seqs, sizes):
            for layout in LAYOUTS:
                runs = {k: [] for k in ("correct", *VARIANTS)}
                padded = False
                for idx in groups:
                    group = [seqs[i] for i in idx]
                    ids, mask, offs = _layout(group, layout, pad)
                    keep = [r for r, o in enumerate(offs) if o > 0]  # an unpadded row is the same either way
                    if not keep:
                        continue
                    padded = True
                    for k, (masked, own) in (("correct", (True, True)), *VARIANTS.items()):
                        got = _generated(model, group, ids, mask, offs, masked, own)
                        for r in keep:
                            runs[k] += [(e, g) for e, g in zip(group[r].logprobs, got[r]) if math.isfinite(e)]
                if not padded or not runs["correct"]:
                    continue
                right = _median([abs(e - g) for e, g in runs["correct"]])
                for k in VARIANTS:
                    d = _median([abs(e - g) for e, g in runs[k]])
                    if right == 0 or d > RATIO * right:
                        continue
                    exact = sum(torch.tensor(e, dtype=torch.float32).item() == torch.tensor(g, dtype=torch.float32).item()
                                for e, g in runs[k])
                    cand = (-exact, d, k, layout, m, len(runs[k]), right)
                    if best is None or cand[:2] < best[:2]:
                        best = cand
    if best is None:
        return None
    neg, d, k, layout, m, n, right = best
    apart = _float64_gap(seqs, model, m, layout, pad, k)
    how = ("each sequence left-padded to the longest" if layout == "whole"
           else "the prompts left-padded to the longest, generated tokens after them (generate()'s sequences rows)")
    found = (f"the file's logprobs are the model's on the sequences batched {m} a call, {how}, but {WORDS[k]} - "
             f"{-neg}/{n} of the padded sequences' tokens bit for bit (median |diff| {d:.3g}), where the same batch "
             f"run right (attention_mask, position_ids counted from each row's first real token) is {right:.3g} away")
    out = {"variant": k, "layout": layout, "batch": m, "tokens": n, "exact_tokens": -neg, "median_abs": d,
           "correct_median_abs": right, "float64_max_abs": apart}
    if apart is None:
        return {**out, "bug": None, "line": (
            f"left padding: {found}. Whether that is another function than the right way was not judged (no "
            f"float64 copy of a model over {MAX_PARAMS:.0e} parameters); pass the attention mask and position_ids "
            "counted from each row's first real token to be sure")}
    if apart <= TOL:
        if -neg < n:
            # the same function as the right way: both are the file's rounding, and a median can favour
            # either by chance (a generate() decode read against prefills) - only every bit names it
            return None
        return {**out, "bug": False, "line": (
            f"left padding: {found}. For this model that is the same function as the right way: with the model in "
            f"float64 the two are {apart:.3g} nats apart at most (its positions are read relative to each other, "
            "as RoPE reads them, so a row's shift by its pad count changes rounding only) - rounding, not a bug")}
    return {**out, "bug": True, "line": (
        f"left padding run wrong: {found}; with the model in float64 the two are {apart:.3g} nats apart: another "
        "function. Whatever wrote the file (the trainer, or the engine) has the classic padding bug: a bug, not "
        "rounding - the tokens of a padded sequence move, and no setting closes it. Pass the attention mask and "
        "position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0) with the padded ids (or pack the sequences "
        "without padding)")}


def _float64_gap(seqs, model, m: int, layout: str, pad: int, variant: str) -> float | None:
    """Max |diff| (nats) between the variant and the right way over the padded sequences' generated
    tokens, with the model cast to float64 (None: the model is too large to copy)."""
    import copy

    import torch

    if sum(p.numel() for p in model.parameters()) > MAX_PARAMS:
        return None
    m64 = copy.deepcopy(model).double()
    worst = 0.0
    with torch.no_grad():
        for idx in next(g for size, g in _batches(seqs, (m,)) if size == m):
            group = [seqs[i] for i in idx]
            ids, mask, offs = _layout(group, layout, pad)
            right = _generated(m64, group, ids, mask, offs, True, True)
            wrong = _generated(m64, group, ids, mask, offs, *VARIANTS[variant])
            for r, o in enumerate(offs):
                if o > 0:
                    worst = max([worst] + [abs(a - b) for a, b in zip(right[r], wrong[r])])
    return worst


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])
