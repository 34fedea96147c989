"""Bounds and causes for modules tpdiag has no layout for (hand-written collectives in user code).

The plan says nothing about such a module, so its bound comes from the module's own records.
A candidate rounding model of what the module computed is accepted only if it explains the
REFERENCE output within that model's own rounding bound, in float64, from the reference's
recorded inputs and parameters:
    copy:    y = c x              an input of the output's shape (a gather, scatter or scale)
    affine:  y = c (x W^T) + b    an input times one of the module's own 2-D parameters
                                  (either orientation), with or without one of its 1-D
                                  parameters as bias; c is a constant scale (1/sqrt(d), ...)
c is fitted on the reference (least squares, float64). The TP=N output is then judged against
the same model: a difference beyond it is a wrong result (`sharding-bug`), one inside it a
reordering, named by the module's recorded ops when there are any (`--granularity auto|op`).

Why the bound is safe (never flags a pure reordering): if the module computes the model's
function, each side evaluates the K-term dot products in some order, blocked and split over
ranks as it likes: Higham Thm 3.5 gives |fl(z) - z| <= gamma_K S, S = |x||W|^T (the sum of
|terms|), for ANY order; the scale, the bias add and the final all-reduce add at most three
more roundings (gamma_{K+3}); TP=N rounds up to N partial sums to the output dtype before
they are added ((N+1) u_out S, as in bounds.linear_bound); each side rounds its result to the
output dtype (u_out |y| each). Two sides: twice the rounding part, plus what the inputs and
parameters differ by, propagated exactly through the linear map (|c|(|dx||W| + |x||dW|) + |db|).
A copy has no reduction: |c||dx| plus each side's rounding of the scaling.
Fitting c adds an error of order u/sqrt(numel) relative to |c|, far inside the extra gamma term.
How far from tight: gamma_K S is the worst case; rounding errors of random sign grow like
sqrt(K) u S, not K u S. Measured (tests/test_generic_bound.py, K=512, TP=2,4,8, partials summed
in three orders): fp32 reorderings reach 0.2-0.4% of the bound, bf16 6-9% (there the bf16
rounding of each partial, u_bf16 S, dominates and S ~ sqrt(K) |y|); the hand-written CPU models
of tests/test_handwritten_tp.py 2-3%. A wrong bias, a permuted gather or a sqrt(N) scale lands
1e3-1e7x beyond it in fp32, but only a few times beyond in bf16 at K=512: there a bug of the
size of y itself is close to what bf16 partials may legitimately lose.
A model the reference does not fit gives no bound: the module computes something else (a
nonlinearity, attention) and the cause stays `unknown`, with `why` saying so.
The one assumption a fit cannot check: c is a constant of the module. A scale computed from
the data by a reduction longer than K (y = z / ||z|| over the whole tensor) fits the reference
too, and its own reordering is not in the bound.
"""
from __future__ import annotations

import torch

from tpdiag.diff.bits import UNIT_ROUNDOFF
from tpdiag.diff.bounds import check, gamma
from tpdiag.records.keys import RecordKey, record_key

F64 = torch.float64
GEMM_OPS = ("mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "addmv", "mv", "dot")
REDUCING_COLLECTIVES = ("allreduce", "all_reduce", "reduce_scatter", "reduce_", "_reduce_scatter")
# the first-pass cap on a model's float64 work (elements of x times columns of W): the region
# pass of a large model records only its located modules, where this is never reached
MAX_WORK = 1 << 28


def _op_base(name: str) -> str:
    """'c10d::allreduce_#0.0' -> 'allreduce_'."""
    return name.rsplit("#", 1)[0].split("::")[-1]


def _is_reducing(op: str) -> bool:
    b = _op_base(op)
    return any(b.startswith(p) for p in REDUCING_COLLECTIVES) and "gather" not in b


def _inputs(dd, row: dict) -> list:
    out, i = [], 0
    while True:
        k = record_key(row["step"], "forward", row["module"], "in", row["call"], i)
        if k not in dd.tensors:
            return out
        out.append((f"in#{i}", dd.tensors[k]))
        i += 1


def _params(dd, row: dict) -> dict:
    step, m = row["step"], row["module"]
    prefix = (RecordKey(0, "init", m, "param_init") if step == 0
              else RecordKey(step - 1, "optimizer", m, "param")).prefix()
    from tpdiag.diff.anchored import read_pair

    # as the step's forward read them (a re-anchored step: the reference's at both sides)
    return {k[len(prefix):]: read_pair(dd, k, step) for k in dd.tensors if k.startswith(prefix)}


def _fit_scale(z: torch.Tensor, target: torch.Tensor) -> float | None:
    zz = float((z * z).sum())
    if not zz > 0:
        return None
    return float((z * target).sum()) / zz


def _u(dtype) -> tuple[float, float]:
    u_acc = UNIT_ROUNDOFF[F64 if dtype == F64 else torch.float32]
    return u_acc, UNIT_ROUNDOFF.get(dtype, u_acc)


def _copy_model(x1, xn, y1, yn):
    """y = c x: (bound, half-bound of the reference) or None if the reference does not fit."""
    a, b, r1, rn = (t.to(F64) for t in (x1, xn, y1, yn))
    c = _fit_scale(a, r1)
    if c is None:
        return None
    _, u_out = _u(y1.dtype)
    u = max(u_out, UNIT_ROUNDOFF[torch.float32])
    half = abs(c) * u * a.abs() + u_out * r1.abs()
    if not bool(((r1 - c * a).abs() <= half).all()):
        return None
    bound = abs(c) * (b - a).abs() + 2 * abs(c) * u * (a.abs() + b.abs()) + u_out * (r1.abs() + rn.abs())
    return bound, c


def _affine_model(x1, xn, w1, wn, b1, bn, y1, yn, world: int):
    """y = c (x W^T) + b with W [out, K] as given: (bound, c) or None if the reference does not fit."""
    k = x1.shape[-1]
    a1, an, v1, vn = (t.to(F64) for t in (x1, xn, w1, wn))
    r1, rn = y1.to(F64), yn.to(F64)
    bb1 = b1.to(F64) if b1 is not None else 0.0
    bbn = bn.to(F64) if bn is not None else 0.0
    z1 = a1 @ v1.T
    c = _fit_scale(z1, r1 - bb1)
    if c is None:
        return None
    u_acc, u_out = _u(y1.dtype)
    s1 = a1.abs() @ v1.abs().T
    g = gamma(k + 3, u_acc) + (world + 1) * u_out
    babs = bb1.abs() if b1 is not None else 0.0
    half = abs(c) * g * s1 + u_out * (r1.abs() + babs)
    if not bool(((r1 - (c * z1 + bb1)).abs() <= half).all()):
        return None
    sn = an.abs() @ vn.abs().T
    bound = abs(c) * ((an - a1).abs() @ vn.abs().T + a1.abs() @ (vn - v1).abs().T)
    bound = bound + abs(c) * g * (s1 + sn) + u_out * (r1.abs() + rn.abs() + 2 * babs)
    if b1 is not None:
        bound = bound + (bbn - bb1).abs()
    return bound, c


def _candidates(dd, row: dict, world: int):
    """Yield (description, bound, K, affine) for every model the reference fits; affine: (this
    side's x, its [out, K] matrix, the parameter's name, the parameter's dim that is K) for
    y = c x W^T + b, None for a copy."""
    y1, yn = dd.tensors[row["key"]]
    ins = [(n, p) for n, p in _inputs(dd, row)
           if p[0].is_floating_point() and p[0].shape == p[1].shape]
    params = {n: p for n, p in _params(dd, row).items()
              if p[0].is_floating_point() and p[0].shape == p[1].shape}
    for name, (x1, xn) in ins:
        if x1.shape == y1.shape:
            got = _copy_model(x1, xn, y1, yn)
            if got is not None:
                yield f"y = {got[1]:.6g} * {name}", got[0], x1.shape[-1] if x1.dim() else 1, None
    for name, (x1, xn) in ins:
        if x1.dim() < 1 or x1.shape[:-1] != y1.shape[:-1]:
            continue
        k, o = x1.shape[-1], y1.shape[-1]
        for wname, (w1, wn) in params.items():
            if w1.dim() != 2 or x1.numel() * o > MAX_WORK:
                continue
            for orient, (v1, vn) in (("^T", (w1, wn)), ("", (w1.T, wn.T))):
                if v1.shape != (o, k):
                    continue
                biases = [(None, (None, None))] + [
                    (bn_, p) for bn_, p in params.items() if p[0].dim() == 1 and p[0].shape[0] == o]
                for bname, (b1, bn) in reversed(biases):
                    got = _affine_model(x1, xn, v1, vn, b1, bn, y1, yn, world)
                    if got is not None:
                        desc = f"y = {got[1]:.6g} * {name} @ {wname}{orient}" + (f" + {bname}" if bname else "")
                        # the weight's input dim: W's dim 1 as W^T is used, dim 0 as W is
                        yield desc, got[0], k, (xn, vn, wname, 1 if orient == "^T" else 0)
                        break


def mark_unreduced_partials(dd) -> None:
    """Hand-written row-parallel code computes plain per-rank partial sums (no DTensor marks
    them `partial`): an op output of one shape at every rank, different bits per rank, inside
    a module that later runs a collective at this degree. It is no value of the reference's
    computation and no replica either - left uncompared, as DTensor partials are. Any collective
    marks it, not only reducing ones: the TP-invariant fixes finish their trees with an
    all-to-all and an all-gather (kernels/tree.py), and what a rank sends is its own data."""
    reduce_at = {}
    for m in dd.uncompared:
        if m.get("kind") == "op" and m["name"].startswith(("c10d::", "_c10d_functional::")):
            k = (m["step"], m["phase"], m["module"])
            reduce_at[k] = max(reduce_at.get(k, -1), m["idx"])
    if not reduce_at:
        return
    keep = []
    for r in dd.rows:
        last = reduce_at.get((r["step"], r["phase"], r["module"]), -1)
        if r["kind"] == "op" and r.get("rank_consistent") is False and r["idx"] < last:
            dd.uncompared.append({**r, "why": "unreduced partial sum (per-rank values before a "
                                              "hand-written reducing collective)"})
            dd.tensors.pop(r["key"], None)
        else:
            keep.append(r)
    dd.rows[:] = keep


def add_generic_bounds(dd, world: int) -> None:
    """Bound every divergent forward output that no layout rule bounded (full capture only)."""
    mark_unreduced_partials(dd)
    for row in dd.rows:
        if (row["phase"] != "forward" or row["kind"] != "out" or row["bitwise"]
                or row.get("bound") is not None or row.get("oracle") or row["key"] not in dd.tensors):
            continue
        y1, yn = dd.tensors[row["key"]]
        if not y1.is_floating_point() or y1.shape != yn.shape or y1.dtype != yn.dtype:
            row["cause_why"] = "its output is not a floating tensor of one shape at both sides"
            continue
        if not _inputs(dd, row):
            row["cause_why"] = ("its inputs were not recorded whole (hash capture, or the module "
                                "takes no tensor), so no rounding bound could be derived")
            continue
        best = None
        for desc, bound, k, affine in _candidates(dd, row, world):
            chk = check(y1, yn, bound)
            # several models may fit the reference (a scale of 1 fits copy and affine alike):
            # keep the most lenient verdict, so a bug is claimed only if every fitting model is
            # exceeded
            if best is None or chk.ratio < best[1].ratio:
                best = (desc, chk, k, affine)
        if best is None and _kernel_path(dd, row, y1, yn):
            continue
        if best is None:
            row["cause_why"] = (
                f"no rounding model fits its reference output: it is neither a scaled copy of an "
                f"input nor c*(x W^T)+b of an input x and one of its own parameters W, so no bound "
                f"could be derived ({row.get('cls') or 'module'} computes something else)")
            continue
        desc, chk, k, affine = best
        row["bound"], row["bound_ratio"], row["beyond_bound"] = chk.bound, chk.ratio, chk.beyond
        row["bound_model"] = desc
        if affine is not None and world > 1:
            _partials(dd, row, affine, world)
        if not chk.beyond:
            cause, why = reorder_cause(dd, row, k)
            row["generic_cause"] = cause
            if why:
                row["cause_why"] = why


def _partials(dd, row: dict, affine, world: int) -> None:
    """A hand-written row-parallel layer (its own F.linear on its slice of K, its own all-reduce, no
    plan): the float64 oracle's floor for the rank partials it rounded and summed
    (diff/rank_partials.py), which a plan's RowwiseParallel Linear gets in locate.add_bounds. Taken
    where the matrix its output fits is recorded cut on the dim that is K - the ranks' shards of
    it, one contiguous chunk each, are smaller than the reference's there: each rank can only have
    summed its own chunk of K - and, where the module's ops were recorded, one of them is a reducing
    collective (a weight all-gathered before one whole GEMM makes no partials). In bf16 a correct
    such layer whose partials cancel read `sharding-bug`, 2.8x (planted cancel_handwritten.py)."""
    from tpdiag.diff import rank_partials

    xn, vn, wname, kdim = affine
    step, m = row["step"], row["module"]
    wkey = (record_key(0, "init", m, "param_init", 0, wname) if step == 0
            else record_key(step - 1, "optimizer", m, "param", 0, wname))
    wrow = next((r for r in dd.rows if r["key"] == wkey), None)
    if wrow is None or wrow.get("layout") != f"shard:{kdim}":
        return
    ops = [n for n, _ in _module_ops(dd, row)]
    if ops and not any(_is_reducing(n) for n in ops):
        return
    p = rank_partials.partials_norm(xn, vn, world)
    if p is not None:
        row["rank_partials_norm"] = p


def _kernel_path(dd, row: dict, y1, yn) -> bool:
    """Equal inputs and parameters, a few ULP apart: `shape-dependent-kernel` (kernel_path.py).
    True when that judged the row (named, or left unknown with its reason)."""
    from tpdiag.diff import kernel_path

    m = row["module"]
    params = _params(dd, row)
    if any(r["module"].startswith(m + ".") for r in dd.rows) or any(
            a.dim() >= 2 for a, _ in params.values()):
        # a module with children or a weight matrix may reduce, or run a collective, in its
        # own code: equal inputs do not make it one kernel on another shape
        return False
    got = kernel_path.judge(y1, yn, _inputs(dd, row), params)
    if got is None:
        return False
    if "why" in got:
        row["cause_why"] = got["why"]
        return True
    chk = check(y1, yn, got["bound"])
    row["bound"], row["bound_ratio"], row["beyond_bound"] = chk.bound, chk.ratio, chk.beyond
    row["bound_model"] = (f"y = f(x), inputs and parameters bitwise equal: one kernel on another "
                          f"local shape, within {kernel_path.PATH_ULPS} ULP")
    row["generic_cause"] = "shape-dependent-kernel"
    return True


def _module_ops(dd, row: dict) -> list[tuple[str, str | None]]:
    """(op name, why-uncompared or None) of every op recorded inside the module's forward."""
    m, step = row["module"], row["step"]

    def mine(r) -> bool:
        return (r.get("kind") == "op" and r.get("step") == step and r.get("phase") == "forward"
                and (r["module"] == m or r["module"].startswith(m + ".")))

    ops = [(r["name"], None if r["bitwise"] else "differs") for r in dd.rows if mine(r)]
    ops += [(r["name"], r.get("why")) for r in dd.uncompared if mine(r)]
    return ops


def _weights_cause(dd, row: dict, what: str) -> tuple[str, str] | None:
    """The reordering a module's own sharded weights name when its ops were not recorded (`what`: how
    it was judged rounding - its bound's or its float64 re-execution's words): a matrix
    cut on its input dim (an F.linear weight [out, in] sharded on dim 1, each rank summing its
    slice of K) makes partial sums the module reduces - `row-parallel-reduction`; one cut on its
    output dim only, a GEMM on another shape - `shape-dependent-gemm`. None: no sharded matrix."""
    m = row["module"]
    cuts = {r.get("layout") for r in dd.rows
            if r.get("kind") == "param_init"
            and (r["module"] == m or r["module"].startswith(m + "."))
            and len(r.get("shape") or ()) == 2}
    names = {"shard:1": "row-parallel-reduction", "shard:0": "shape-dependent-gemm"}
    for cut in ("shard:1", "shard:0"):
        if cut in cuts:
            return names[cut], (f"rounding: {what}; its ops were not recorded, and "
                                f"its weights are cut on their {'input' if cut == 'shard:1' else 'output'} "
                                f"dim ({cut}), which names the reordering")
    return None


def _rows_cause(dd, row: dict, what: str) -> tuple[str, str] | None:
    """The reordering a module's input names when its ops were not recorded and it holds no sharded
    matrix: its input split on a dim before the last (each rank its own tokens: sequence
    parallelism), so every kernel in it ran on fewer rows per call - `batch-variant-kernel`. (A
    sequence-parallel MoE routes other token counts to each expert on each rank: the ranks' op
    streams differ, no op-level rerun; its correct layer read `unknown` and failed the gate.)"""
    src = next((r for r in dd.rows if r.get("kind") == "in" and r["module"] == row["module"]
                and r.get("step") == row["step"] and r.get("phase") == "forward"
                and r.get("call") == row.get("call") and str(r.get("name")) == "0"), None)
    layout, shape = (src or {}).get("layout") or "", (src or {}).get("shape") or ()
    if not layout.startswith("shard:") or not layout[6:].isdigit() or len(shape) < 2 \
            or int(layout[6:]) >= len(shape) - 1:
        return None
    return "batch-variant-kernel", (f"rounding: {what}; its ops were not recorded, and its input is "
                                    f"split on dim {layout[6:]} (each rank its own rows), so its "
                                    "kernels ran on fewer rows per call")


def reorder_cause(dd, row: dict, k: int | None) -> tuple[str, str | None]:
    """Name the reordering behind a difference judged rounding (inside a bound, or near the
    float64 oracle), from the module's ops."""
    what = (f"within the rounding bound of its length-{k} reduction" if k is not None
            else "near its float64 re-execution")
    ops = _module_ops(dd, row)
    if not ops:
        by_layout = _weights_cause(dd, row, what) or _rows_cause(dd, row, what)
        if by_layout is not None:
            # judged rounding all the same: `unknown` would fail the gate closed on a reordering
            # its bound or the float64 run proved (ops go unrecorded where the ranks' op streams differ, a
            # bias added on rank 0 only: no op-level rerun)
            return by_layout
        return "unknown", (f"rounding: {what} (a reordering, not a wrong result); its ops were not "
                           "recorded, so which computation was reordered is not known")
    reducing = sorted({_op_base(n) for n, _ in ops if _is_reducing(n)})
    if reducing:
        return "row-parallel-reduction", None
    gemms = [n for n, why in ops if _op_base(n) in GEMM_OPS and why is not None]
    if gemms:
        return "shape-dependent-gemm", None
    from tpdiag.records.ops import ATTENTION_OPS, is_op_of

    changed = [n for n, why in ops if why == "differs"]
    if any(is_op_of(n.rsplit("#", 1)[0], ATTENTION_OPS) for n in changed):
        return "attention-kernel", None
    if changed:
        # equal inputs, another result, no collective, no GEMM: one kernel (a reduction, a
        # norm, a softmax) computed the same function on another local shape
        return "shape-dependent-kernel", None
    return "unknown", (f"rounding: {what}, but none of its recorded ops differs or is a reducing "
                       "collective")


def why_unknown(row: dict) -> str:
    """Why a record's cause is `unknown` (every `unknown` in a summary carries one)."""
    if row.get("cause_why"):
        return row["cause_why"]
    if row["kind"] == "in":
        parent = row["module"].rpartition(".")[0] or "model"
        return (f"the difference arises in code of {parent} that no probed module runs, and "
                "no op there was recorded")
    if row.get("hash_only"):
        return ("recorded as a hash only: no values to bound-check (the region pass records the "
                "located module whole)")
    if row["phase"] == "forward" and row["kind"] == "out" and row.get("bound") is None:
        return "no bound could be derived: its inputs or parameters were not recorded whole"
    return (f"no rule names a cause for a {row['phase']} {row['kind']} record of "
            f"{row.get('cls') or 'this module'} (layout {row.get('style') or 'none'}) and no bound "
            "applies to it")
