"""Which steps' unjudged grads are measured against the rounding limit (diff/moved_limit.py): the
first differing step, and a later one whose forward stayed within a few times that step's move."""
from __future__ import annotations

from tpdiag.diff.moved_limit import EPS


def first_step(rows: list[dict]):
    """The step of the first record that differs: the one step whose unjudged grads rel_l2 measures.
    From it on the weights the optimizer updated differ too, and a correct model's grads move by far
    more than rounding moves one step: llama-1b bf16 --tp 1,2 --steps 3 on 2x H200 (Adam's first
    update is about lr * sign(grad), so a grad's near-zero elements rounded to the other sign move
    their weights 2 lr apart) listed grads 2.9 of their norm off and read "not judged" (gate 1)."""
    return next((r.get("step") for r in sorted(rows, key=lambda r: r["idx"]) if not r["bitwise"]), None)


# a later step's forward may move this many times the first differing step's own forward move and its
# weights still count as the reference's up to rounding (oracle.MARGIN): tiny-llama --steps 3, correct,
# moved its forward records 5.0e-7 at step 0 and 4.7e-5 at step 1 in float32 (94x: Adam's sign-like
# update), 0.0094 and 0.14 in bfloat16 (15x) - those steps stay unmeasured, as the first_step rule had it
DRIFT_MARGIN = 8.0
# ... and only where the first step's forward moved as rounding moves it (1.2 eps of float32 in the
# planted step_stale_grad.py, 1.2 eps of bfloat16 in tiny-llama), not by a flipped near tie's O(1)
BASE_ROUNDINGS = 64


def measured_steps(rows: list[dict]) -> set[str]:
    """The steps whose unjudged grads rel_l2 measures: the first differing one (first_step), and a
    later one whose forward records moved no more than DRIFT_MARGIN times the first step's did - its
    weights not moved apart by the updates, so a grad of it that moved far moved by the step's own
    code. A backward memo keyed too loosely (tests/models/planted/step_stale_grad.py:stale_grad_drop)
    moved mlp's output grad half its norm at step 1 of a float32 run whose forward stayed at 1.5e-7,
    and read rounding only with the first step alone measured."""
    first = first_step(rows)
    if first is None:
        return set()
    moved: dict[str, float] = {}
    eps = []
    for r in rows:
        if r["phase"] == "forward" and r["kind"] in ("in", "out") and not r["bitwise"]:
            v = r.get("rel_l2")
            v = float("inf") if not isinstance(v, float) or v != v else v
            moved[str(r.get("step"))] = max(moved.get(str(r.get("step")), 0.0), v)
            if str(r.get("step")) == str(first):
                eps.append(EPS.get(str(r.get("dtype") or "").replace("torch.", ""), EPS["bfloat16"]))
    base = moved.get(str(first), 0.0)
    if base > BASE_ROUNDINGS * max(eps or [EPS["bfloat16"]]):
        # its move not measured (no tensors), or past a few roundings (a discrete choice flipped by
        # rounding moves what follows it by O(1)): no scale for the later steps' drift
        return {str(first)}
    steps = {str(r.get("step")) for r in rows}
    return {str(first)} | {s for s in steps if moved.get(s, 0.0) <= DRIFT_MARGIN * base}
