"""Which fixes are on in this process (set by their context managers, read by the runner)."""
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
