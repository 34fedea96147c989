"""The own-input pass's side of module_probes: other worlds' whole inputs and output grads, loaded
once a block, and which children's output grads a module's float64 backward taps."""
from __future__ import annotations

from torch import nn


class OwnFiles:
    """own: {label: file} of other worlds' whole inputs and output grads, read at first use."""

    def __init__(self, own: dict[str, str] | None):
        self.own = own
        self._loaded: dict = {}
        self._taps: list = []

    def inputs(self) -> dict:
        if not self._loaded:
            from safetensors.torch import load_file

            self._loaded.update({lab: load_file(path) for lab, path in self.own.items()})
        return self._loaded

    def taps(self) -> set | None:
        """The children whose output grads the diff reads from a float64 backward (the own-input
        files' metadata: runner/drill_own.own_files); None, every child, where a file names none."""
        if not self._taps:
            from tpdiag.records.own_taps import taps_named

            self._taps.append(taps_named(self.own.values()))
        return self._taps[0]


def children_of(mod, infos: dict, multi_out: set, counts: dict, step, wanted: set | None = None) -> dict:
    """{submodule: record name} of the modules whose output grads mod's float64 backward
    taps: those its forward calls itself (its direct children, and those of a container it
    holds: a ModuleList's layers, which it loops over; the container itself is never
    called), and the descendants of one that no float64 backward judges by itself - called
    other than once in the step so far (counts: this step's forward calls), or returning several
    floating tensors (multi_out; two_paths:pair_f's stage): the diff judges their output grads by
    the next ancestor that qualifies (diff/enclosing.judge), up to the root. infos: module_probes'
    per-module infos (the record name first). wanted: only those names (the own-input pass's taps,
    diff/own_inputs.taps)."""
    got, todo = {}, list(mod.children())
    while todo:
        c = todo.pop()
        if isinstance(c, (nn.ModuleList, nn.ModuleDict)):
            todo.extend(c.children())
            continue
        if c not in infos:
            continue
        n = got[c] = infos[c][0]
        if n in multi_out or counts.get((step, "forward", n), 0) != 1:
            todo.extend(c.children())  # its children's grads: judged by mod (or above it)
    return got if wanted is None else {c: n for c, n in got.items() if n in wanted}
