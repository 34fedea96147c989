"""The recorder's phase as a scope, and the host time the step spent in each (timings' phases_s)."""
from __future__ import annotations

import time
from contextlib import contextmanager


class Phases:
    """`with phases("loss"):` records made inside, the op probe's included, are the loss
    phase's; on exit the recorder is back in the phase it was in (scopes nest: a piece's
    backward runs inside its loss phase's loss context). Host time is the host's view: a phase
    that waits on the GPU includes the wait."""

    def __init__(self, rec):
        self.rec = rec
        self.marks: dict[str, float] = {}
        self._since = time.perf_counter()
        self._open: list[str] = []  # the mark each open scope's time goes under

    @contextmanager
    def __call__(self, phase: str, last: str | None = None, timed: bool = True):
        """last: the mark the scope's time after its last lap() goes under (the phase's own);
        timed=False: no mark (its time is no phase's)."""
        if self._open:
            self.lap(self._open[-1])  # the enclosing scope's time so far
        self._since = time.perf_counter()
        self._open.append((last or phase) if timed else "")
        outer, self.rec.phase = self.rec.phase, phase
        try:
            yield self
        finally:
            self.lap(self._open.pop())
            self.rec.phase = outer

    def lap(self, mark: str) -> None:
        """The host time since the scope began or the last lap, added to marks[mark] ('': to none)."""
        now = time.perf_counter()
        if mark:
            self.marks[mark] = self.marks.get(mark, 0.0) + now - self._since
        self._since = now
