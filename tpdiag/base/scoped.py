"""A process-wide memo that lives only inside session() blocks - one compare - and is dropped when
the outermost block ends: a process that reads runs again later (a notebook, the test suite, a
gate after a compare) starts afresh with the code and files it has then. Bounded: past `limit`
entries it starts over. Used by diff/pair_memo.py (measured pairs) and records/checked.py
(hash-checked tensors)."""
from __future__ import annotations

import contextlib


class Scoped:
    def __init__(self, limit: int):
        self.limit = limit
        self.data: dict = {}
        self._depth = 0

    @contextlib.contextmanager
    def session(self):
        """Entries kept inside this block stay for the rest of it (nested blocks share them)."""
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if not self._depth:
                self.data.clear()

    @property
    def active(self) -> bool:
        return self._depth > 0

    def get(self, key):
        return self.data.get(key) if key is not None and self.active else None

    def put(self, key, value) -> None:
        if key is None or not self.active:
            return
        if len(self.data) >= self.limit:
            self.data.clear()
        self.data[key] = value

    def clear(self) -> None:
        self.data.clear()
