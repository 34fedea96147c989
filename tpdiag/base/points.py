"""The configurations one compare runs: a world is a point on the axes (tp, micro_batch, mode).

Every configuration has a stable label, which names its directory (`tp{label}`) and its entry in
summary.json. A configuration that differs from the reference only in TP keeps the plain degree
label ("2", "1-2" for a repeat), so run directories written before the other axes existed read
the same; any other carries its axes in the label ("1-mb2", "2-mb2", "1-decode").
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

from tpdiag.errors import BadInput

# decode: the prompt in one call, then one token per call through the model's KV cache
# (tpdiag/runner/decode.py), forward only
MODES = ("prefill", "decode")
TP, MICRO_BATCH, MODE = "tp", "micro_batch", "mode"


@dataclass(frozen=True)
class Point:
    tp: int
    micro_batch: int = 0  # sequences per forward call; 0: the whole batch in one call
    mode: str = "prefill"

    def to_dict(self) -> dict:
        return {"tp": self.tp, "micro_batch": self.micro_batch, "mode": self.mode}


@dataclass(frozen=True)
class World:
    label: str
    point: Point
    axis: str  # the axes it differs from the reference in, '+'-joined ("tp", "micro_batch", "tp+micro_batch"); "" for the reference


def config_name(label) -> str:
    """How output names a configuration: 'TP=2' for a degree (or a repeat, 'TP=1-2'), else its
    axes spelled out: '1-mb2' -> 'TP=1 mb=2', '2-decode' -> 'TP=2 decode'."""
    parts = str(label).split("-")
    if len(parts) == 1 or parts[1].isdigit():
        return f"TP={label}"
    words = [f"TP={parts[0]}"] + [f"mb={p[2:]}" if p.startswith("mb") and p[2:].isdigit() else p
                                  for p in parts[1:]]
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
           grid: bool = False, degree_labels=None) -> list[World]:
    """The reference (the first value of every axis) first, then the TP axis as it always was,
    then the other axes one at a time, or (grid) every other combination."""
    mbs = micro_batches or (0,)
    modes = modes or ("prefill",)
    ref = Point(degrees[0], mbs[0], modes[0])
    tp_labels = degree_labels(degrees)
    out = [World(tp_labels[0], ref, "")]
    for d, lab in zip(degrees[1:], tp_labels[1:]):
        out.append(World(lab, Point(d, mbs[0], modes[0]), TP))
    if grid:
        others = [Point(d, mb, mo) for d, mb, mo in itertools.product(dict.fromkeys(degrees), mbs, modes)
                  if (mb, mo) != (mbs[0], modes[0])]
    else:
        others = [Point(degrees[0], mb, modes[0]) for mb in mbs[1:]] + \
                 [Point(degrees[0], mbs[0], mo) for mo in modes[1:]]
    seen = set()
    for p in others:
        lab = label_of(p, mbs[0], modes[0])
        if lab in seen:
            continue
        seen.add(lab)
        out.append(World(lab, p, axis_of(p, ref)))
    return out


def label_of(p: Point, mb0: int, mode0: str) -> str:
    lab = str(p.tp)
    if p.micro_batch != mb0:
        lab += f"-mb{p.micro_batch}"
    if p.mode != mode0:
        lab += f"-{p.mode}"
    return lab


def axis_of(p: Point, ref: Point) -> str:
    diff = [name for name, a, b in ((TP, p.tp, ref.tp), (MICRO_BATCH, p.micro_batch, ref.micro_batch),
                                    (MODE, p.mode, ref.mode)) if a != b]
    return "+".join(diff) or TP  # a rerun of the reference's degree (--tp 1,1) is on the TP axis
