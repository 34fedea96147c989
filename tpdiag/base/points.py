"""The configurations one compare runs: a world is a Config (tpdiag/base/configs.py) on the axes
tp, micro_batch and mode (and attention and padding, where asked for).

Every configuration has a stable label (Config.compare_key), which names its directory (`tp{label}`,
tpdiag.records.rundir.RunDir) and its entry in summary.json. A configuration that differs from
the reference only in TP keeps the plain degree label ("2", "1-2" for a repeat), so run directories
written before the other axes existed read the same; any other carries its axes in the label
("1-mb2", "2-mb2", "1-decode", "1-eager").
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

from tpdiag.base.configs import (ATTENTION, ATTENTIONS, MICRO_BATCH, MODE, MODES, PADDING, PADDINGS,  # noqa: F401
                                 TP, Config)
from tpdiag.errors import BadInput

Point = Config  # the name compare's code used before rollout and compare shared the one type


@dataclass(frozen=True)
class World:
    label: str
    point: Config
    axis: str  # the axes it differs from the reference in, '+'-joined ("tp", "micro_batch", "tp+micro_batch"); "" for the reference


def config_name(label) -> str:
    """How output names a configuration: 'TP=2' for a degree (or a repeat, 'TP=1-2'), else its
    axes spelled out: '1-mb2' -> 'TP=1 mb=2', '2-decode' -> 'TP=2 decode', '1-padleft' ->
    'TP=1 pad=left'."""
    parts = str(label).split("-")
    if len(parts) == 1 or parts[1].isdigit():
        return f"TP={label}"
    words = [f"TP={parts[0]}"]
    for p in parts[1:]:
        if p.startswith("mb") and p[2:].isdigit():
            words.append(f"mb={p[2:]}")
        elif p.startswith("pad") and p[3:] in PADDINGS:
            words.append(f"pad={p[3:]}")
        elif words[-1] == "sdpa" and f"sdpa-{p}" in ATTENTIONS:
            words[-1] = f"sdpa-{p}"
        else:
            words.append(p)
    return " ".join(words)


def parse_micro_batches(text: str | None) -> tuple[int, ...]:
    """'4,1' -> (4, 1); None or '' -> () (the whole batch per call, no micro-batch axis)."""
    if text is None or str(text).strip() == "":
        return ()
    parts = [p.strip() for p in str(text).split(",")]
    out = []
    for p in parts:
        try:
            out.append(int(p))
        except ValueError:
            raise BadInput(f"--micro-batch {text!r}: {p!r} is not an integer; expected sequences per "
                           "call, e.g. 4,1") from None
    if any(n < 1 for n in out):
        raise BadInput(f"--micro-batch {text!r}: every size must be >= 1")
    no_repeat("--micro-batch", text, out)
    return tuple(out)


def parse_modes(text: str | None) -> tuple[str, ...]:
    if text is None or str(text).strip() == "":
        return ("prefill",)
    out = tuple(p.strip().lower() for p in str(text).split(","))
    for m in out:
        if m not in MODES:
            raise BadInput(f"--mode {text!r}: {m!r} is not a mode; expected one of {', '.join(MODES)}")
    no_repeat("--mode", text, out)
    return out


def no_repeat(option: str, text, values) -> None:
    """A value listed twice would run a second world of the very configuration the first one is (no
    label tells them apart) and compare it as another: refused, by compare and rollout alike. (compare's
    `--tp 2,2` is different: its second world is a labelled rerun of the reference, a documented check.)"""
    seen = set()
    for v in values:
        if v in seen:
            raise BadInput(f"{option} {text!r}: {v} is listed twice; list each value once (the first is "
                           "the reference)")
        seen.add(v)


def check_micro_batches(sizes: tuple[int, ...], batch_size: int) -> None:
    for n in sizes:
        if n > batch_size or batch_size % n:
            raise BadInput(f"--micro-batch {n}: must divide --batch-size {batch_size} (every micro-batch "
                           f"holds the same number of sequences); e.g. "
                           f"{','.join(str(d) for d in _divisors(batch_size))}")


def _divisors(n: int) -> list[int]:
    return sorted((d for d in range(1, n + 1) if n % d == 0), reverse=True)


def worlds(degrees: tuple[int, ...], micro_batches: tuple[int, ...] = (), modes: tuple[str, ...] = ("prefill",),
           grid: bool = False, degree_labels=None, attentions: tuple[str, ...] = (), paddings: tuple[str, ...] = (),
           flags: str = "default", fix: str = "none") -> list[World]:
    """The reference (the first value of every axis) first, then the TP axis as it always was,
    then the other axes one at a time, or (grid) every other combination. flags and fix are the
    run's own (every world's), not axes."""
    mbs = micro_batches or (0,)
    modes = modes or ("prefill",)
    atts = attentions or ("auto",)
    pads = paddings or ("auto",)
    ref = Config(degrees[0], mbs[0], modes[0], fix, flags, atts[0], pads[0])
    tp_labels = degree_labels(degrees)
    out = [World(tp_labels[0], ref, "")]
    for d, lab in zip(degrees[1:], tp_labels[1:]):
        out.append(World(lab, ref.with_(tp=d, repeat=lab.partition("-")[2]), TP))
    if grid:
        others = [ref.with_(tp=d, micro_batch=mb, mode=mo, attention=a, padding=pa)
                  for d, mb, mo, a, pa in itertools.product(dict.fromkeys(degrees), mbs, modes, atts, pads)
                  if (mb, mo, a, pa) != (mbs[0], modes[0], atts[0], pads[0])]
    else:
        others = [ref.with_(micro_batch=mb) for mb in mbs[1:]] + [ref.with_(mode=mo) for mo in modes[1:]] + \
                 [ref.with_(attention=a) for a in atts[1:]] + [ref.with_(padding=pa) for pa in pads[1:]]
    seen = set()
    for p in others:
        lab = p.compare_key(ref)
        if lab in seen:
            continue
        seen.add(lab)
        out.append(World(lab, p, axis_of(p, ref)))
    return out


def axis_of(p: Config, ref: Config) -> str:
    return "+".join(p.differs(ref)) or TP  # a rerun of the reference's degree (--tp 1,1) is on the TP axis


# the axes a compare records for each configuration (manifest.json's `configurations`, each
# summary entry's `config`): these always, attention and padding where the run varies them
COMPARE_AXES = (TP, MICRO_BATCH, MODE)


def recorded_axes(worlds) -> tuple[str, ...]:
    ws = list(worlds)
    if not ws:
        return COMPARE_AXES
    ref = ws[0].point
    extra = tuple(a for a in (ATTENTION, PADDING) if any(getattr(w.point, a) != getattr(ref, a) for w in ws))
    return COMPARE_AXES + extra
