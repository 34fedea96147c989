"""The own-input float64 verdicts (the second pass): every divergent record past the first
divergence whose inputs already differed, judged against the reference's module re-executed in
float64 on THIS side's own inputs (diff/own_inputs.py chose the modules; diff/oracle.py judges the
first divergence against the reference's own re-execution)."""
from __future__ import annotations

import math

import torch

from tpdiag.diff.equal_inputs import side_params
from tpdiag.diff.oracle import judge_own, mark_no_reference, no_reference, notes_for
from tpdiag.diff import choices_followed, choices_made, enclosing, flip_unjudged, other_paths, rank_partials
from tpdiag.diff.own_side import REFUSED, judge_own_side
from tpdiag.records.keys import sole_consumer
from tpdiag.records.layout import first_positions


def _own_grad_in(dd, row: dict, table: dict):
    """A grad_out record's value from its one consumer's float64 backward (table: the grad_in
    re-executions from the reference's inputs or from this side's)."""
    c = sole_consumer(row.get("consumers"))
    if c is None:
        return None
    got = [(k, v) for k, v in table.items() if k[0] == row["step"] and k[1] == c]
    if len(got) != 1 or len(got[0][1]) != 1:
        return None
    return got[0][1][0]


# the reference's own relative distance from its float64 re-execution above which that value is
# no reference for the record: far beyond any dtype's rounding (bf16's unit roundoff is 0.4%)
NO_REFERENCE = 0.05


def _scaled_instead(row: dict, y_ref, y_n, o_ref, norms=None) -> bool:
    """A record the module's float64 re-execution does not reproduce even at the reference - a
    user's grad hook rescales it (a static loss scale undone per parameter) - is no evidence of
    rounding: both sides are "near" only because the level is the reference's own O(1) distance.
    Such a record is judged as a capture's is, by one factor times the reference's (diff/scale.py):
    the replicated grads divided by S * TP where S belongs (tests/models/planted/tp_misc.py
    scale_tp) read `rounding only`. Only where the reference is itself one factor times its float64
    value (the hook's mark): a reference far from it by its own rounding (catastrophic cancellation:
    a row's output dominated by its mean's rounding, one offset that each side rounds its own way)
    also moves by "one factor" between the sides, and is rounding."""
    from tpdiag.diff.scale import coherent_scale, scale_of_sums

    if o_ref is None:
        # the reference's world kept the sums of its re-execution against its record instead
        # (probes/oracle_hooks.ref_norms: [.., o.o, o.y, y.y, sum o^4, numel])
        sums = [float(x) for x in norms.to(torch.float64).reshape(-1)] if norms is not None else []
        if len(sums) < 7 or scale_of_sums(*sums[2:6], int(sums[6])) is None:
            return False
    elif o_ref.shape != y_ref.shape or coherent_scale(o_ref, y_ref) is None:
        return False
    c = coherent_scale(y_ref, y_n)
    if c is not None:
        row["scale"] = c
    return c is not None


def _residual_norms(y_ref, y_n, o_ref, o_n, norms, side_n) -> tuple[float, float] | None:
    """(||y_ref - o_ref||, ||y_n - o_n||): each side's distance from its own float64 re-execution,
    from the values or from the norms a world kept instead (probes/oracle_hooks.NORMS: [||o||,
    ||y - o||, ..]; probes/own_side_norms.py: [||o_n||, ||y_n - o_n||, ..])."""
    from tpdiag.probes.own_side_norms import E

    def dist(y, o):
        return float(torch.linalg.vector_norm(y.to(torch.float64) - o.to(torch.float64)))

    if o_ref is not None:
        e_ref = dist(y_ref, o_ref) if o_ref.shape == y_ref.shape else None
    elif norms is not None and norms.numel() >= 2:
        e_ref = float(norms.to(torch.float64).reshape(-1)[1])
    else:
        e_ref = None
    if o_n is not None:
        e_n = dist(y_n, o_n) if o_n.shape == y_n.shape else None
    elif side_n is not None and side_n.numel() > E:
        e_n = float(side_n.to(torch.float64).reshape(-1)[E])
    else:
        e_n = None
    return None if e_ref is None or e_n is None else (e_ref, e_n)


def _residual_scaled(row: dict, y_ref, y_n, e_ref: float, e_n: float) -> bool:
    """A record its module's float64 re-execution does not reproduce even at the reference, nor is
    one factor times it: the user adds a term of their own that the re-execution does not compute
    (L2 weight decay in a grad hook: g + wd * p). That term is each side's residual r = y - o from
    its own re-execution. Computed the same way at every degree it is the same at every degree
    (the params are equal here) and "near" stands; where this side's residual is one factor c times
    the reference's, the term was computed another number of times (every rank adding it before
    the ranks' grads are summed: TP times) - no reordering does that. Known from the norms alone:
    the records' difference is the residuals' (the re-executions from the two sides' inputs agree
    to rounding), and ||r_n - r_ref|| = | ||r_n|| - ||r_ref|| | only where they are parallel. A
    difference that is one offset repeated (a mean's rounding under catastrophic cancellation, each
    side rounding it its own way: _scaled_instead) is left to the near verdict."""
    from tpdiag.diff.scale import MAX_RESIDUAL, MIN_SCALE

    if not (e_ref > 0 and math.isfinite(e_ref) and math.isfinite(e_n)) or y_ref.shape != y_n.shape:
        return False
    c = e_n / e_ref
    d_y = y_n.to(torch.float64) - y_ref.to(torch.float64)
    d = float(torch.linalg.vector_norm(d_y))
    # beyond 8x either way two unrelated residuals (each side's own rounding) look parallel too:
    # the longer one is nearly their difference
    if abs(c - 1) < MIN_SCALE or not 1 / MAX_RATIO <= c <= MAX_RATIO or not math.isfinite(d) or d == 0:
        return False
    if abs(d - abs(e_n - e_ref)) > MAX_RESIDUAL * d:  # not parallel: another term, or rounding
        return False
    if float(torch.linalg.vector_norm(d_y - d_y.mean())) < OFFSET_SPREAD * d:
        return False
    row["scale"], row["scale_of"] = c, "residual"
    return True


# a difference whose spread about its mean is under this share of its norm is one offset repeated
OFFSET_SPREAD = 0.5
MAX_RATIO = 8.0


def apply_own(dd) -> None:
    """Every divergent record past the first that the reference's own oracle could not judge
    (its inputs differ), judged against the reference module re-run on this side's inputs."""
    own = getattr(dd, "oracle_own", None) or {}
    side = getattr(dd, "oracle_own_norms", None) or {}
    if not own and not side and not getattr(dd, "grad_in_own", None):
        return
    for row in dd.rows:
        if row["bitwise"] or row.get("oracle") or row.get("nonfinite_mismatch") \
                or row.get("rank_consistent") is False or row["key"] not in dd.tensors \
                or row.get("reads_written"):  # its inputs are not known: diff/written_state.py
            continue
        k = row["key"]
        # the re-execution is the REFERENCE's module (its parameters) on this side's inputs: where
        # this side's parameters differ (a step after the first update: its rounding), it is not
        # the function this side computed, and no value to judge it by (--steps 2 read the
        # built-in model's step-1 embedding a BUG, 15x "beyond rounding": the update's rounding)
        judged_by = sole_consumer(row.get("consumers")) if row["kind"] == "grad_out" else row["module"]
        outer = None
        if judged_by is None and (row["phase"], row["kind"]) == ("backward", "grad_out"):
            # no one module consumer: the module whose own code reads it (diff/enclosing.py)
            outer, o_n, o_ref = enclosing.tapped(dd, row)
            judged_by = outer if o_n is not None and o_ref is not None else None
        # (from this side's own parameters where the reference world re-executed it so: side_params)
        if judged_by is None or not side_params(dd, judged_by, row["step"]):
            continue
        norms = side_n = None
        if outer is not None:
            pass  # o_n, o_ref: the enclosing module's float64 backward through this output
        elif row["phase"] == "backward" and row["kind"] == "grad_out":
            o_n, o_ref = _own_grad_in(dd, row, dd.grad_in_own), _own_grad_in(dd, row, dd.grad_in)
            if o_n is not None and o_ref is not None and k in dd.tensors:
                # a residual add beside its consumer: each side's own grad through it added
                # (diff/other_paths.py); none explaining the reference's distance: not judged
                path, d = other_paths.split(dd, row, o_ref)
                if path == "":
                    row["oracle_refused"] = other_paths.UNEXPLAINED.format(d)
                    continue
                if path is not None:
                    row["other_path"] = path
                    o_n, o_ref = other_paths.with_path(dd, path, o_n, 1), other_paths.with_path(dd, path, o_ref, 0)
        elif (row["phase"], row["kind"]) in (("forward", "out"), ("backward", "param_grad")):
            o_n, o_ref = own.get(k), dd.oracle.get(k)
            # the reference's world kept only its re-execution's norms (probes/oracle_hooks.NORMS)
            norms = (getattr(dd, "oracle_norms", None) or {}).get(k) if o_ref is None else None
            # and of its re-execution from this side's inputs (probes/own_side_norms.py)
            side_n = side.get(k) if o_n is None and not row.get("positions") else None
        else:
            continue
        if o_n is None and side_n is None:
            continue
        y_ref, y_n = dd.tensors[k]
        o_ref = None if o_ref is None else first_positions(o_ref, y_n, row.get("positions"))
        if side_n is not None:
            v = judge_own_side(y_ref, y_n, o_ref, side_n, dd.hash_version, ref_norms=norms,
                               partials=rank_partials.partials_in(dd, row))
            if v is REFUSED:
                row["oracle_refused"] = REFUSED["refused"]
                continue
        else:
            v = judge_own(y_ref, y_n, o_ref, first_positions(o_n, y_n, row.get("positions")), ref_norms=norms,
                          partials=rank_partials.partials_in(dd, row))
        if v is None:
            continue
        # a tapped grad: the enclosing module's choices (a router inside it), not a consumer's
        discrete = notes_for(dd, {**row, "consumers": [outer]} if outer is not None else row).get("discrete")
        if discrete and no_reference(v):
            mark_no_reference(v, discrete)
        if not v["far"] and v.get("ref_err", 0.0) > NO_REFERENCE:
            if _scaled_instead(row, y_ref, y_n, o_ref, norms):
                continue  # no verdict from a value that is no reference
            es = _residual_norms(y_ref, y_n, o_ref, None if o_n is None else first_positions(o_n, y_n, row.get("positions")),
                                 norms, side_n)
            if es is not None and _residual_scaled(row, y_ref, y_n, *es):
                continue  # the user's own term, computed another number of times
        if row.get("other_path"):
            v["what"] = "its consumer's backward" + other_paths.what(dd, row["other_path"])
        row["oracle"] = v
        followed = None
        if v["far"] and discrete and row["phase"] == "backward" and not v.get("no_reference"):
            # its float64 backward starts from the forward whose every row reproduced each run's: the
            # same choices, so far is a wrong grad (diff/choices_followed.py)
            followed = choices_followed.forward_followed(dd, judged_by, row["step"], discrete)
        made = choices_made.followed(dd, row) if v["far"] and discrete and not v.get("no_reference") else None
        if followed is not None:
            v.pop("discrete", None)
            v["choices_followed"] = {"ops": list(discrete), "forward": followed}
        elif made is not None:
            # each float64 run made its side's own choices, flipped tokens included: far is the rest
            # of the module computing another function (diff/choices_made.py)
            v.pop("discrete", None)
            v["choices_made"] = made
        elif v["far"] and discrete:
            if flip_unjudged.shows_nothing(row, v):
                flip_unjudged.leave_unjudged(row, v, discrete)
                continue
            if row["phase"] == "backward" and choices_followed.forward_flipped(dd, judged_by, row["step"]):
                # the forward's own rows show the float64 run chose otherwise than a run: its backward
                # is another function's (an honest bf16 top-2 MoE at --steps 3, step 2: the router's
                # output grad 0.077 off, the reference 0.006), held to not_judged's limit instead
                flip_unjudged.leave_unjudged(row, v, discrete, flip_unjudged.FLIPPED_SIDE)
                continue
            v["discrete"] = list(discrete)
            row["oracle_flip"] = True
            continue
        if outer is not None:
            row["enclosing"] = outer
            v["what"] = f"the enclosing module's ({outer}) backward"
        what = "float64 re-execution of the " + (f"enclosing module's ({outer}) backward" if outer is not None else {
            "param_grad": "module's backward", "grad_out": "consumer's backward"}.get(row["kind"], "module")) \
            + other_paths.what(dd, row.get("other_path")) + " from this side's own inputs"
        if v["far"]:
            row["beyond_bound"] = True
            row["bound_ratio"] = max(row.get("bound_ratio") or 0.0, v["ratio"])
            row.pop("generic_cause", None)
            if y_ref.shape == y_n.shape and y_ref.is_floating_point():
                from tpdiag.diff.scale import coherent_scale

                row["far_scale"] = coherent_scale(y_ref, y_n)  # the reason it is far, where one factor
        elif row.get("beyond_bound"):
            # a layout bound on inputs that already differed was too tight: the module, given
            # exactly what this side gave it, computed its value within rounding
            row["beyond_bound"] = False
            row["bound_ratio"] = v["ratio"]
        row["bound_model"] = f"{row['bound_model']}; {what}" if row.get("bound_model") else what
