"""A module called in two reentrant activation checkpoints (tests/models/planted/ckpt_twice.py:
one nn.GELU shared by two checkpointed blocks): the backward recomputes the second block first, so
the module's first recompute is its SECOND forward call (probes/recompute.py). Main at b260af8
numbered recomputes in the order they came: block1.act's grad_out#0 held the second call's grad
(bitwise the un-checkpointed run's grad_out#1) and the first call's float64 backward was run from
the first call's inputs with the second call's output grad. Checked in process at TP=1: every
backward record of the checkpointed model is bitwise the same model's without checkpointing."""
import importlib.util
import pathlib

import torch

from tpdiag.probes.module_probe import module_probes
from tpdiag.probes.recorder import Recorder
from tpdiag.probes.stream import as_tensor, finish

_PATH = pathlib.Path(__file__).parent / "models" / "planted" / "ckpt_twice.py"


def _planted():
    spec = importlib.util.spec_from_file_location("tpdiag_planted_ckpt_twice", _PATH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _backward_records(ckpt: bool) -> dict:
    planted = _planted()
    torch.manual_seed(0)
    model = planted.SharedActLM(ckpt)
    tokens = torch.randint(0, planted.VOCAB, (planted.BATCH, planted.SEQ), generator=torch.Generator().manual_seed(1))
    rec = Recorder()
    with module_probes(model, rec, plan={}, backward=True, oracle={"block1.act"}):
        rec.phase = "forward"
        out = model(tokens)
        rec.phase = "backward"
        out.float().pow(2).mean().backward()
    finish(rec.records)
    return {m["key"]: as_tensor(t) for m, t in rec.records if m["phase"] == "backward"}


def test_a_module_in_two_checkpoints_records_each_calls_own_grads():
    ckpt, plain = _backward_records(True), _backward_records(False)
    act = [k for k in plain if "/block1.act/" in k]
    # the shared module's two calls, its own output grads and its float64 input grads, each call's
    assert any("grad_out#0" in k for k in act) and any("grad_out#1" in k for k in act), act
    assert any("oracle" in k and "c0" in k for k in act) and any("oracle" in k and "c1" in k for k in act), act
    # the two calls' grads differ: a record of one call under the other's number cannot pass
    g0, = [plain[k] for k in act if "grad_out#0" in k]
    g1, = [plain[k] for k in act if "grad_out#1" in k]
    assert not torch.equal(g0, g1)
    assert sorted(ckpt) == sorted(plain)
    wrong = [k for k in plain if not torch.equal(ckpt[k], plain[k])]
    assert not wrong, wrong
