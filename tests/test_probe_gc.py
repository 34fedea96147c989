"""module_probes pauses Python's automatic cyclic GC while its hooks are in (full collections
inside a probed step: `git show d055ef2:docs/benchmarks.md`, "Second round") and restores
it on exit, also on an error; TPDIAG_PROBE_GC=1 leaves it alone."""
import gc

import pytest
import torch
from torch import nn

from tpdiag.probes.module_probe import module_probes
from tpdiag.probes.recorder import Recorder


def _model():
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))


def test_gc_paused_in_probes_and_restored(monkeypatch):
    monkeypatch.delenv("TPDIAG_PROBE_GC", raising=False)
    assert gc.isenabled()
    m, rec = _model(), Recorder(mode="hash")
    with module_probes(m, rec):
        assert not gc.isenabled()
        m(torch.randn(2, 4)).sum().backward()
    assert gc.isenabled()
    assert len(rec.records) > 0  # the probes ran
    with pytest.raises(RuntimeError):
        with module_probes(m, Recorder(mode="hash")):
            raise RuntimeError("boom")
    assert gc.isenabled()


def test_gc_left_alone_when_asked_or_already_off(monkeypatch):
    monkeypatch.setenv("TPDIAG_PROBE_GC", "1")
    with module_probes(_model(), Recorder(mode="hash")):
        assert gc.isenabled()
    monkeypatch.delenv("TPDIAG_PROBE_GC")
    gc.disable()
    try:
        with module_probes(_model(), Recorder(mode="hash")):
            assert not gc.isenabled()
        assert not gc.isenabled()  # a caller's own pause is not undone
    finally:
        gc.enable()
