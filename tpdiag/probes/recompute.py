"""Which forward call a reentrant activation checkpoint's recompute is (probes/module_probe.py).

The backward recomputes checkpointed segments in its own order - the last segment first - so the
n-th recompute of a module is not its n-th forward call where the module ran in two segments (one
block applied twice, a module shared by two checkpointed layers): counted, the second call's output
grads were recorded as the first's, and the first call's float64 backward was run from its own
inputs with the second call's output grad. A segment is found again by its root's inputs: the
reentrant recompute runs the checkpointed function on `detach()`es of the very tensors the forward
was given (same storage), and within a segment the recompute calls the modules in forward order.
Where no segment matches (the checkpointed function is no module, a non-reentrant checkpoint whose
forward had a graph), the n-th recompute stands for call n, as before.
"""
from __future__ import annotations

import torch


def _key(name: str, tensors) -> tuple | None:
    with torch._C.DisableTorchFunction():
        ptrs = tuple(getattr(t, "_local_tensor", t).data_ptr() for t in tensors)
    return (name, ptrs) if ptrs else None


class Recomputes:
    __slots__ = ("step", "segs", "open", "rc", "rc_root", "counts", "pending")

    def __init__(self):
        self.step = None
        self.segs: list = []     # this step's segments: [key, {name: [forward calls]}, {name: seen}]
        self.open = None         # (root module, its segment) while a no-graph segment's forward runs
        self.rc = None           # the segment being recomputed, matched by its root's inputs
        self.rc_root = None
        self.counts: dict = {}   # (step, name) -> recomputes so far (the fallback numbering)
        self.pending: dict = {}  # module -> the calls its recomputes in progress stand for

    def _at(self, step) -> None:
        if step != self.step:
            self.step, self.segs, self.open, self.rc, self.rc_root = step, [], None, None, None

    def forward(self, step, mod, name: str, call: int, tensors) -> None:
        """A forward call of the step (pre-hook): remembered where it runs without a graph inside
        a segment whose root was given a tensor that requires grad (a reentrant checkpoint)."""
        if torch.is_grad_enabled():
            return
        self._at(step)
        if self.open is None:
            if not any(t.requires_grad for t in tensors):
                return
            key = _key(name, tensors)
            if key is None:
                return
            seg = [key, {}, {}]
            self.segs.append(seg)
            self.open = (mod, seg)
        self.open[1][1].setdefault(name, []).append(call)

    def forward_done(self, mod) -> None:
        if self.open is not None and self.open[0] is mod:
            self.open = None

    def recompute(self, step, mod, name: str, tensors) -> None:
        """A recompute's call starts (pre-hook, inside the backward)."""
        self._at(step)
        if self.rc is None:
            key = _key(name, list(tensors))
            for seg in reversed(self.segs):
                if seg[0] == key and not seg[2]:
                    self.rc, self.rc_root = seg, mod
                    break
        call = None
        if self.rc is not None:
            k = self.rc[2].get(name, 0)
            self.rc[2][name] = k + 1
            calls = self.rc[1].get(name, ())
            call = calls[k] if k < len(calls) else None
        self.pending.setdefault(mod, []).append(call)

    def recompute_done(self, step, mod, name: str) -> int:
        """The forward call the finished recompute call stands for."""
        got = self.pending.get(mod)
        call = got.pop() if got else None
        if self.rc_root is mod and not got:
            self.rc, self.rc_root = None, None
        ck = (step, name)
        n = self.counts[ck] = self.counts.get(ck, -1) + 1
        return n if call is None else call
