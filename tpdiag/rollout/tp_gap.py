"""Is a TP degree's logprob gap to TP=1 rounding? (docs/rl.md, `tp_gap`)

A TP > 1 configuration and its TP=1 twin (every other setting the same) differ only in where the
partial sums of the sharded GEMMs and the vocab softmax are added - rounding - unless the trainer's
TP plan computes another function (a fused gate_up Linear cut like two, a norm over a rank's
columns). The rounding the kernels give is read from the run itself, at TP=1: the same
configuration under the other `--fix` value (the fixes reorder the same sums), at micro-batch 1,
and in the other mode. A gap far beyond all of them is not rounding. Seen (tests/models/
user_glm4_rl.py): GLM-4's gate_up_proj cut ColwiseParallel() puts rank 0's gate columns against
gate columns: TP=2 was 4.19 nats (max) from TP=1 while `what to do` read "nothing to do".
"""
from __future__ import annotations

from tpdiag.base.configs import STATIC_PADDINGS, Config
from tpdiag.rollout.batch_leak import FLOOR, RATIO, mean_max_gap


def _lab(c: Config, **kw) -> str:
    return Config(**{**{a: getattr(c, a) for a in ("tp", "micro_batch", "mode", "fix", "flags", "attention",
                                                      "padding")}, **kw}).rollout_name()


def _baselines(c: Config, seqs, trainer: dict, fixes: list[str]) -> dict[str, float]:
    """{what: mean |diff|} of the TP=1 pairs that differ by rounding alone, as the run measured them."""
    base = {}
    pairs = [(f"TP=1 under fix {f} against fix {c.fix}", _lab(c, tp=1, fix=f), _lab(c, tp=1))
             for f in fixes if f != c.fix]
    # under the fixes micro-batch and mode give the same bits by design: no rounding scale there
    if c.fix == "none" and c.micro_batch > 1:
        pairs.append((f"TP=1 at micro-batch {c.micro_batch} against 1", _lab(c, tp=1), _lab(c, tp=1, micro_batch=1)))
    if c.fix == "none":
        other = "prefill" if c.mode == "decode" else "decode"
        # decode has no packed form, prefill no static cache: the other mode's twin is read padded
        pad = "auto" if c.padding in ("packed", *STATIC_PADDINGS) else c.padding
        pairs.append((f"TP=1 {c.mode} against {other}", _lab(c, tp=1, padding=pad),
                      _lab(c, tp=1, mode=other, padding=pad)))
    for name, x, y in pairs:
        if x in trainer and y in trainer:
            g = mean_max_gap(seqs, trainer[x], trainer[y])
            if g is not None:
                base[name] = g[0]
    return base


def find(configurations: list[Config], seqs, trainer: dict) -> dict:
    """{TP > 1 configuration: {tp, tp1, gap, max_abs, rounding, ratio, baselines, bug}} for each TP > 1
    configuration with a TP=1 twin whose mean |diff| to it is past FLOOR; `bug` where it is beyond
    RATIO x the largest rounding the run measured, None where it measured none (or only bitwise pairs)."""
    fixes = list(dict.fromkeys(c.fix for c in configurations))
    out = {}
    for c in configurations:
        lab, twin = c.rollout_name(), _lab(c, tp=1)
        if c.tp == 1 or lab not in trainer or twin not in trainer:
            continue
        got = mean_max_gap(seqs, trainer[lab], trainer[twin])
        if got is None or got[0] <= FLOOR:
            continue
        base = _baselines(c, seqs, trainer, fixes)
        rounding = max(base.values(), default=0.0)
        # no pair measured, or every one bitwise: the run shows no rounding scale to hold the gap
        # against, and a BUG is never called without one
        out[lab] = {"tp": c.tp, "tp1": twin, "gap": got[0], "max_abs": got[1], "rounding": rounding,
                    "ratio": got[0] / rounding if rounding > 0 else None, "baselines": base,
                    "bug": (got[0] > RATIO * rounding) if rounding > 0 else None}
    return out


def notes(gaps: dict, model: str, dtype: str, invariance: dict) -> list[str]:
    """The under-the-fixes lines (rollout/tp_invariance.py) of the degrees not judged a bug here - a
    judged bug needs no hedged line too - then one line per TP degree: its largest gap, judged."""
    from tpdiag.rollout import tp_invariance

    judged = {gaps[lab]["tp"] for lab in bugs(gaps)}
    out = tp_invariance.notes({k: v for k, v in invariance.items() if v["tp"] not in judged}, model, dtype)
    worst = {}
    for lab, v in gaps.items():
        if v["tp"] not in worst or v["gap"] > gaps[worst[v["tp"]]]["gap"]:
            worst[v["tp"]] = lab
    for tp, lab in sorted(worst.items()):
        v = gaps[lab]
        said = ", ".join(f"{k} {x:.3g}" for k, x in v["baselines"].items())
        head = (f"{lab} is {v['gap']:.3g} nats (mean |diff|; max {v['max_abs']:.3g}) from {v['tp1']}, the same "
                "configuration at TP=1")
        cmd = f"`tpdiag compare --model {model} --tp 1,{tp} --dtype {dtype}` names the module"
        if v["bug"]:
            against = f"{v['ratio']:.0f}x the largest rounding gap the run shows at TP=1 ({said})"
            out.append(f"{head}, {against}: the trainer's TP={tp} path computes another function than TP=1 - "
                       f"a bug in its TP plan or sharded code, not rounding; {cmd}")
        elif v["bug"] is None:
            out.append(f"{head}, and the run measured no rounding at TP=1 to hold it against"
                       + (f" ({said}: bitwise)" if said else "") + ": run with --fix none,all (or a second "
                       f"--micro-batch or --mode, stock) to judge it, or {cmd} and says BUG or rounding")
    return out


def bugs(gaps: dict) -> list[str]:
    return [lab for lab, v in gaps.items() if v["bug"]]
