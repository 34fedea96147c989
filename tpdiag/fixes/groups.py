"""The run's tree groups G: into how many fixed global groups the invariant fixes cut a reduced
dimension (kernels/tree.py). Chosen once per run and carried by every world's config, so every
rank of every world (and every confirm / fix-chain / matrix rerun) reduces in the same tree.

Default: the largest TP degree the run compares. That degree then holds ONE group per rank, so
its row-parallel forward and column-parallel dgrad are one invariant GEMM with fp32 output plus
the cross-rank tree - the production degree pays about a plain GEMM - and every other degree
computes each of its groups with that same call ("per-group"). A G above every degree
(--tree-groups, or TPDIAG_TREE_GROUPS) keeps a rank's groups fused in one tree_mm call
("fused"). The two are other bits from each other; G and the choice are in the run's provenance
and `tpdiag diff` refuses two runs that differ in them.
"""
from __future__ import annotations

import os

from tpdiag.errors import BadInput

ENV = "TPDIAG_TREE_GROUPS"
PER_GROUP, FUSED = "per-group", "fused"
# what a run directory written before G was a run setting used
LEGACY = (8, FUSED)


def grouped(fixes) -> tuple[str, ...]:
    """The fixes of `fixes` whose reductions are cut into the G groups (the others ignore G)."""
    from tpdiag.fixes.registry import grouped as of_catalogue

    return of_catalogue(fixes)


def uses_groups(fixes) -> bool:
    return bool(grouped(fixes))


def _pow2(n: int) -> bool:
    return n >= 1 and not n & (n - 1)


def explicit(option: int | None) -> tuple[int, str] | None:
    """(G, where it came from) when the user chose G: --tree-groups, else TPDIAG_TREE_GROUPS."""
    if option:
        return int(option), f"--tree-groups {option}"
    text = os.environ.get(ENV, "").strip()
    if not text:
        return None
    try:
        return int(text), f"{ENV}={text}"
    except ValueError:
        raise BadInput(f"{ENV}={text!r}: expected a power-of-two number of tree groups, e.g. 8") from None


def choose(degrees, option: int | None = None) -> tuple[int, str]:
    """(G, group GEMM) for a run over `degrees`."""
    top = max(degrees)
    chosen = explicit(option)
    g = chosen[0] if chosen else top
    return g, PER_GROUP if g == top else FUSED


def check(degrees, fixes, option: int | None = None) -> None:
    """One line before any world starts: a chosen G must be a power of two that every degree
    divides; with a grouped fix on, the degrees must be powers of two."""
    if option is not None and option < 0:
        raise BadInput(f"--tree-groups {option}: must be a power of two >= 1 (0: the default)")
    chosen = explicit(option)
    if chosen:
        g, src = chosen
        if not _pow2(g):
            raise BadInput(f"{src}: the tree groups must be a power of two >= 1, e.g. {max(degrees)}")
        bad = next((d for d in degrees if g % d), None)
        if bad is not None:
            raise BadInput(f"{src}: TP={bad} does not divide {g} tree groups; every degree must "
                           f"(the default is the largest degree, {max(degrees)})")
    bad = next((d for d in degrees if not _pow2(d)), None)
    if bad is not None and uses_groups(fixes):
        raise BadInput(f"TP={bad} with {', '.join(grouped(fixes))}: the "
                       "invariant reductions need power-of-two degrees")


def resolve(cfg):
    """cfg (a CompareConfig) with tree_groups / group_gemm set; unchanged when already set, so
    a rerun made from a resolved config keeps the parent run's G."""
    if cfg.tree_groups and cfg.group_gemm:
        return cfg
    g, gemm = choose(cfg.degrees, cfg.tree_groups or None)
    return cfg.with_(tree_groups=g, group_gemm=gemm)


def of_config(c: dict) -> tuple[int, str]:
    """(G, group GEMM) a world or run config records (LEGACY for one written before)."""
    g, gemm = c.get("tree_groups"), c.get("group_gemm")
    return (int(g), str(gemm)) if g and gemm else LEGACY


def describe(groups: int, gemm: str) -> str:
    how = ("one invariant GEMM per group" if gemm == PER_GROUP
           else "a rank's groups fused in tree_mm")
    return f"tree groups G={groups} ({how})"
