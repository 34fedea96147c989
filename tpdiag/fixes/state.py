"""Which fixes are on in this process: apply_fixes (fixes/registry.py) marks each fix active for
as long as it is installed. A fix's own code reads its own name; everything else asks by
property (fixes/registry.py: takes_over, carrying), so it never names a fix."""
from __future__ import annotations

from contextlib import contextmanager

_ACTIVE: dict[str, int] = {}


def active(name: str) -> bool:
    return _ACTIVE.get(name, 0) > 0


@contextmanager
def flag(name: str):
    _ACTIVE[name] = _ACTIVE.get(name, 0) + 1
    try:
        yield
    finally:
        _ACTIVE[name] -= 1
        if not _ACTIVE[name]:
            del _ACTIVE[name]
