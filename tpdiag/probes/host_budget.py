"""Sizes for full capture's host side: parsing a size setting, the default host budget."""
from __future__ import annotations

import os


def parse_bytes(text: str, what: str) -> int:
    """'1073741824', '512M', '2G' -> bytes (binary units)."""
    from tpdiag.errors import BadInput

    s = str(text).strip().upper().removesuffix("B").removesuffix("I")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(s[-1:], 1)
    try:
        n = int(float(s[:-1] if mult > 1 else s) * mult)
    except (ValueError, OverflowError):  # not a number, or inf
        n = -1
    if n <= 0:
        raise BadInput(f"{what}={text!r}: expected a positive size in bytes (e.g. 536870912, 512M, 2G)")
    return n


def default_budget() -> int:
    """Half the host memory available now, shared by the ranks on this host."""
    from tpdiag.base.hostmem import mem_available

    avail = mem_available()
    if avail is None:
        avail = 16 << 30
    return max(avail // 2 // local_ranks(), 1 << 20)


def local_ranks() -> int:
    """The ranks sharing this host's budget: LOCAL_WORLD_SIZE (torchrun's), else TPDIAG_LOCAL_RANKS (each
    world's own, unless the user set it), else 1. A value that is no whole number is BadInput, which
    compare checks before any world (runner/checks.py): `int()` here failed every rank."""
    for name in ("LOCAL_WORLD_SIZE", "TPDIAG_LOCAL_RANKS"):
        v = os.environ.get(name, "").strip()
        if v:
            if not (v.isascii() and v.isdigit()):
                from tpdiag.errors import BadInput

                raise BadInput(f"{name}={v!r}: expected a whole number of ranks on this host")
            return max(int(v), 1)
    return 1
