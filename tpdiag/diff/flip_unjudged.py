"""A backward float64 verdict through a discrete choice that judges nothing either way (helper hreview18):
the float64 run chose otherwise than both runs. Such a grad is left to not_judged's limit on how far it
moved (diff/not_judged.py), beside diff/choices_followed.py's verdicts that do judge."""
from __future__ import annotations

# why such a grad is left to not_judged (its reason there, summary.json `not_judged`)
FLIPPED_BOTH = ("its module's float64 backward chose otherwise than both runs at a discrete choice ({ops}): "
                "no reference, and this side no further from it than the reference - judged as a record no "
                "check judged (how far it moved)")


def shows_nothing(row: dict, v: dict) -> bool:
    """A backward verdict through a choice that judges nothing either way: the float64 re-execution chose
    otherwise than the REFERENCE too (no_reference: the reference more than its margin of roundings
    from it) and this side is no further from it than the threshold that distance sets (ratio <= 1) -
    both runs made one choice, the float64 run another. Such a grad is a record no check judged, held
    to not_judged's limit on how far it moved (diff/not_judged.py), as the forward's rows are held to
    theirs: made an `unknown` finding, an honest bf16 top-2 MoE whose router scores sit near ties
    (tests/models/planted/moe_resid.py:resid_ok: its experts' weight grads and the router's output
    grad 0.6 of their norm from the float64 run, on both sides alike) read `not judged (cause
    unknown)` and failed `gate --allow rounding` (85e6ea9: rounding, the verdict dropped). Where
    this side is further than that, or the reference is a reference, the verdict stands (a BUG where
    the forward followed the runs' choices, else an unknown finding)."""
    r = v.get("ratio")
    return row["phase"] == "backward" and row["kind"] in ("grad_out", "param_grad") and bool(v.get("no_reference")) \
        and isinstance(r, float) and r <= 1.0


FLIPPED_SIDE = ("its module's float64 forward chose otherwise than the runs at a discrete choice ({ops}): a row "
                "of its output beyond a few roundings of the run's (diff/choices_followed.forward_flipped), so its "
                "backward is another function's - judged as a record no check judged (how far it moved)")


def leave_unjudged(row: dict, v: dict, discrete, why: str = FLIPPED_BOTH) -> None:
    """The row as no check judged it (shows_nothing, or a forward that shows the flip), with the
    reason not_judged lists."""
    row.pop("oracle", None)
    row["oracle_refused"] = why.format(ops=", ".join(discrete or v.get("discrete") or ()))
