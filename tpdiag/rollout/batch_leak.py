"""Does a sequence's result depend on the other sequences in its call beyond rounding?

The same model, settings and tokens at micro-batch M and at micro-batch 1 differ only in the
call's shape (batch-variant kernels: rounding) - unless the model lets the call's other rows or
their padding into a sequence. The rounding the kernels give is read from the run itself: the
same M-vs-1 gap in the other mode, and prefill against decode at micro-batch 1. A gap far beyond
both is not rounding. Seen: transformers 5.24's MiniMax, whose decode step after a left-padded
prompt moves a sequence 0.39 nats from that sequence decoded alone (its prefill with the same
padding is the sequence's own to 1e-6) - generate() over a padded batch gives those numbers, and
`rollout` reproduced them bit for bit and called the trainer's gap to them rounding.

Stock configurations only (fix none): the fixes change what is batch-variant.
"""
from __future__ import annotations

from tpdiag.base.configs import STATIC_PADDINGS, Config

# far beyond the rounding the run shows elsewhere (mean |diff|), and not itself rounding-sized
RATIO = 10.0
FLOOR = 1e-3  # nats


def mean_max_gap(seqs, a, b) -> tuple[float, float] | None:
    """(mean, max) of |a - b| over the generated tokens where both are finite (None: none). The mean
    judges: rounding moves a few tokens by up to its max and most by nothing, a leak moves every
    affected sequence's tokens (MiniMax, bf16: mean 0.060 against 5.9e-05 and 0.0032 for the
    baselines; max 0.36 against 0.0042 and 0.061 - the max alone is 6x)."""
    import torch

    parts = []
    for s, x, y in zip(seqs, a, b):
        x, y = x[s.prompt_len - 1:].double(), y[s.prompt_len - 1:].double()
        both = torch.isfinite(x) & torch.isfinite(y)
        parts.append((x[both] - y[both]).abs())
    d = torch.cat(parts) if parts else None
    if d is None or not d.numel():
        return None
    return float(d.mean()), float(d.max())


def find(configurations: list[Config], seqs, trainer: dict) -> dict | None:
    """{configuration, alone, mode, gap, rounding, ratio, baselines, line} for the first stock
    configuration at micro-batch > 1 whose sequences are far from the same ones at micro-batch 1;
    None when none is (or the run has no twin or no rounding to measure against)."""
    def lab(c: Config, **kw) -> str:
        return Config(**{**{a: getattr(c, a) for a in ("tp", "micro_batch", "mode", "fix", "flags",
                                                          "attention", "padding")}, **kw}).rollout_name()

    for c in configurations:
        if c.fix != "none" or c.micro_batch <= 1 or c.rollout_name() not in trainer:
            continue
        other = "prefill" if c.mode == "decode" else "decode"
        alone = lab(c, micro_batch=1)
        if alone not in trainer:
            continue
        got = mean_max_gap(seqs, trainer[c.rollout_name()], trainer[alone])
        if got is None:
            continue
        gap, most = got
        base = {}
        # decode has no packed form: a packed prefill's rounding between call shapes is read padded;
        # prefill has no static cache: a static decode's prefill baselines are read padded
        pad = {"prefill": "auto" if c.padding in ("packed", *STATIC_PADDINGS) else c.padding,
               "decode": "auto" if c.padding == "packed" else c.padding}
        for name, x, y in ((f"{other} at micro-batch {c.micro_batch} against 1",
                            lab(c, mode=other, padding=pad[other]),
                            lab(c, mode=other, micro_batch=1, padding=pad[other])),
                           ("prefill against decode at micro-batch 1",
                            lab(c, micro_batch=1, mode="prefill", padding=pad["prefill"]),
                            lab(c, micro_batch=1, mode="decode", padding=pad["decode"]))):
            if x in trainer and y in trainer:
                g = mean_max_gap(seqs, trainer[x], trainer[y])
                if g is not None:
                    base[name] = g[0]
        rounding = max(base.values(), default=0.0)
        # no baseline measured: nothing to hold the gap against. Every baseline bitwise: this run's
        # kernels gave no rounding between call shapes at all, so a gap past FLOOR is not rounding
        if not base or gap <= FLOOR or gap <= RATIO * rounding:
            continue
        said = ", ".join(f"{k} {v:.3g}" for k, v in base.items())
        against = (f"{gap / rounding:.0f}x the largest mean gap the other settings show ({said})" if rounding > 0
                   else f"while every other setting gives the same bits ({said})")
        reach = ("the sequences packed before it in its row" if c.padding == "packed" else
                 f"the {'left' if c.mode == 'decode' else 'right'} padding of shorter prompts")
        line = (f"{c.rollout_name()} is {gap:.3g} nats (mean |diff|; max {most:.3g}) from the same sequences "
                f"one per call ({alone}), {against}: in this model's "
                f"{c.mode} a sequence's logprobs depend on the other sequences in its call beyond rounding "
                f"({reach}, or another row, reaching it) - a bug in the model's {c.mode} path "
                "(transformers' code for an hf: model), not a kernel's rounding; "
                + ("a trainer that packs this model's sequences trains on these numbers: pad instead (its "
                   "layers do not all restart at the position ids)" if c.padding == "packed" else
                   "an engine that batches this way reports these numbers"))
        return {"configuration": c.rollout_name(), "alone": alone, "mode": c.mode, "gap": gap, "max_abs": most,
                "rounding": rounding, "ratio": gap / rounding if rounding > 0 else None, "baselines": base,
                "line": line}
    return None
