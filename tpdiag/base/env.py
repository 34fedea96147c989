"""Whole numbers read from the environment: one parse and one message for every TPDIAG_* knob of
that kind. `int()` at a world's import failed every rank with a ValueError, and a value read as the
default instead said nothing - the user's setting was not the one applied. BadInput, one line;
compare calls each reader before any world (runner/checks.py)."""
from __future__ import annotations

import os


def whole(name: str, default: int, unit: str = "") -> int:
    """os.environ[name] as a whole number, 0 or more (unset or empty: default); unit names what it
    counts in the message (" of MiB")."""
    v = os.environ.get(name, "").strip()
    if not v:
        return default
    if not (v.isascii() and v.isdigit()):
        from tpdiag.errors import BadInput

        raise BadInput(f"{name}={v!r}: expected a whole number{unit}, 0 or more (default {default})")
    return int(v)
