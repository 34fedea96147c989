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


# A row's result that depends on how many rows share the call (micro-batch size, decode) can come
# from any kernel that blocks its work by the rows in the call; together these compute each row
# the same way whatever the call holds, so they are what removes it
# (tp-invariant-linear too: a row-parallel Linear's CPU GEMM runs in fixed row blocks only under it)
BATCH_INVARIANT = ("invariant-gemm", "tp-invariant-linear", "invariant-attention", "invariant-norm-grad",
                   "invariant-vocab-softmax")


# The fixes whose Functions feed grad accumulation's fp32 carry (kernels/grad_carry.py): the
# batch-invariant GEMM (linear, bias and embedding weight grads) and the norm weight grad. With
# either on, the runner opens the accumulation window in every world (runner/micro.py).
CARRY_FIXES = ("invariant-gemm", "invariant-norm-grad")


def fixes_for_cause(cause: str, op: str | None = None) -> tuple[str, ...]:
    """The fixes that remove `cause` (fix_for_cause's one, or the batch-invariant set)."""
    from tpdiag.records.ops import SDPA_OPS, is_op_of

    if cause == "batch-variant-kernel":
        if is_op_of(op, SDPA_OPS):
            return ("invariant-attention",)
        cat = catalogue()
        return tuple(n for n in BATCH_INVARIANT if n in cat and cat[n].install is not None)
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
        return tuple(n for n, f in cat.items() if f.install is not None)
    for n in names:
        if n not in cat:
            raise BadInput(f"--fix {n!r}: unknown fix; expected all, auto, none or any of "
                           f"{', '.join(cat)}")
        if cat[n].install is None:
            raise BadInput(f"--fix {n!r}: not available in this build yet")
    return tuple(names)


@contextmanager
def apply_fixes(names, model, plan, world: int):
    cat = catalogue()
    with ExitStack() as stack:
        for n in names:
            stack.enter_context(cat[n].install(model=model, plan=plan, world=world))
        yield
