"""A world's progress inside its step, for the live status line: rank 0 writes a short text
("call 512 of 1025") to a file beside its markers at most once a second; launch.run_world's
wait loop reads it and passes it on as the status "running:TEXT". A decode world at 1 x 2048 is
1,025 calls and most of a minute: without it the line says only "running"."""
from __future__ import annotations

import os
import time

EVERY_S = 1.0
NAME = "rank0.progress"


class Reporter:
    """reporter(text): written when a second has passed since the last write (rank 0 only)."""

    def __init__(self, out_dir: str, rank: int):
        self.path = os.path.join(out_dir, NAME) if out_dir and rank == 0 else None
        self.last = 0.0

    def __call__(self, text: str) -> None:
        if self.path is None:
            return
        now = time.monotonic()
        if now - self.last < EVERY_S:
            return
        self.last = now
        try:
            tmp = self.path + ".tmp"
            with open(tmp, "w") as f:
                f.write(text)
            os.replace(tmp, self.path)
        except OSError:  # the status line is a courtesy: never the step's failure
            self.path = None


def read(out_dir: str) -> str | None:
    try:
        with open(os.path.join(out_dir, NAME)) as f:
            return f.read().strip() or None
    except OSError:
        return None


def clear(out_dir: str) -> None:
    try:
        os.remove(os.path.join(out_dir, NAME))
    except OSError:
        pass
