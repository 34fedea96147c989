"""Looking fixes up and applying them. Each fix is a context manager that restores in `finally`;
the entries themselves are in catalogue.py."""
from __future__ import annotations

from contextlib import ExitStack, contextmanager

from tpdiag.errors import BadInput
from tpdiag.fixes.catalogue import FIXES, Fix


def catalogue() -> dict[str, Fix]:
    return FIXES


def fix_for_cause(cause: str, op: str | None = None) -> str | None:
    """The fix that removes `cause`; `op`: the op it was located at. A nondeterministic kernel
    has no fix in general, but an attention kernel's has: invariant-attention's backward is
    deterministic (no atomics)."""
    from tpdiag.records.ops import SDPA_OPS, is_op_of

    if cause == "nondeterministic-kernel" and is_op_of(op, SDPA_OPS):
        return "invariant-attention"
    for f in catalogue().values():
        if cause in f.fixes:
            return f.name
    return None


def available() -> tuple[str, ...]:
    return tuple(n for n, f in catalogue().items() if f.install is not None)


def grouped(names=None) -> tuple[str, ...]:
    """Of `names` (None: the catalogue), the fixes whose reductions are cut into the G groups."""
    cat = catalogue()
    return tuple(n for n in (cat if names is None else names or ()) if n in cat and cat[n].grouped)


def carry_fixes(names=None) -> tuple[str, ...]:
    """Of `names` (None: the catalogue), the fixes whose Functions feed grad accumulation's fp32
    carry (kernels/grad_carry.py); with one on, the runner opens the accumulation window in every
    world (runner/micro.py)."""
    cat = catalogue()
    return tuple(n for n in (cat if names is None else names or ()) if n in cat and cat[n].carries_grads)


def batch_invariant() -> tuple[str, ...]:
    """The available fixes that compute a row the same whatever rows share its call, in their
    declared order: together they remove a batch-variant kernel (any kernel that blocks its work
    by the rows in the call can cause one)."""
    cat = catalogue()
    return tuple(sorted((n for n, f in cat.items() if f.batch_invariant and f.install is not None),
                        key=lambda n: cat[n].batch_invariant))


def _on():
    from tpdiag.fixes import state

    return [f for n, f in catalogue().items() if state.active(n)]


def takes_over(what: str) -> bool:
    """Whether a fix on in this process takes over `what` (catalogue.TAKES_OVER): the loss, the
    grad norm, a per-head norm's grad all-reduce - asked where that is computed."""
    return any(what in f.takes_over for f in _on())


def carrying() -> bool:
    """Whether a fix on in this process feeds grad accumulation's fp32 carry."""
    return any(f.carries_grads for f in _on())


def fixes_for_cause(cause: str, op: str | None = None) -> tuple[str, ...]:
    """The fixes that remove `cause` (fix_for_cause's one, or the batch-invariant set)."""
    from tpdiag.records.ops import SDPA_OPS, is_op_of

    if cause == "batch-variant-kernel":
        if is_op_of(op, SDPA_OPS):
            return ("invariant-attention",)
        return batch_invariant()
    fix = fix_for_cause(cause, op)
    return (fix,) if fix else ()


def resolve(names) -> tuple[str, ...]:
    """'all' -> every available fix; 'a,b' -> validated names. Unknown names are BadInput."""
    cat = catalogue()
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    names = list(names)
    if names in (["none"], []):
        return ()
    if names == ["all"]:
        return available()
    for n in names:
        if n not in cat:
            raise BadInput(f"--fix {n!r}: unknown fix; expected all, auto, none or any of "
                           f"{', '.join(cat)}")
        if cat[n].install is None:
            raise BadInput(f"--fix {n!r}: not available in this build yet")
    return tuple(names)


@contextmanager
def apply_fixes(names, model, plan, world: int):
    """Every fix in `names`, marked active (fixes/state.py) for as long as it is installed."""
    from tpdiag.fixes import state

    cat = catalogue()
    with ExitStack() as stack:
        for n in names:
            stack.enter_context(state.flag(n))
            stack.enter_context(cat[n].install(model=model, plan=plan, world=world))
        yield
