"""A module called in two reentrant activation checkpoints (tests/models/planted/ckpt_twice.py:
one nn.GELU shared by two checkpointed blocks): the backward recomputes the second block first, so
the module's first recompute is its SECOND forward call (probes/recompute.py). Main at b260af8
numbered recomputes in the order they came: block1.act's grad_out#0 held the second call's grad
(bitwise the un-checkpointed run's grad_out#1) and the first call's float64 backward was run from
the first call's inputs with the second call's output grad. Checked in process at TP=1: every
backward record of the checkpointed model is bitwise the same model's without checkpointing."""
import importlib.util
import pathlib

import pytest
import torch

from conftest import compare_planted

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


def test_a_block_with_weights_in_two_checkpoints_records_each_weight_grad_once():
    """ckpt_twice.py's LoopLM: one MLP applied twice, each application in its own reentrant
    checkpoint. Each segment's inner backward adds into the weights' .grad, and the accumulate hook
    recorded each weight grad once per segment: on 170f498 `param_grad ... listed twice` and the
    reference failed (the run inconclusive). The grad is now held and recorded once, as the step's
    backward ends: every backward record - each weight grad once, with the sum of both applications -
    is bitwise the un-checkpointed model's, and the float64 grads of both calls are there."""
    planted = _planted()

    def records(ckpt):
        torch.manual_seed(0)
        model = planted.LoopLM(ckpt)
        tokens = torch.randint(0, planted.VOCAB, (planted.BATCH, planted.SEQ),
                               generator=torch.Generator().manual_seed(1))
        rec = Recorder()
        with module_probes(model, rec, plan={}, backward=True, oracle={"mlp", "mlp.up"}):
            rec.phase = "forward"
            out = model(tokens)
            rec.phase = "backward"
            out.float().pow(2).mean().backward()
        finish(rec.records)
        return [(m["key"], as_tensor(t)) for m, t in rec.records if m["phase"] == "backward"]

    ckpt, plain = records(True), records(False)
    keys = [k for k, _ in ckpt]
    assert len(keys) == len(set(keys)), sorted(k for k in keys if keys.count(k) > 1)
    grads = [k for k in keys if "/param_grad#" in k and k.startswith("s0/backward/mlp.")]
    assert sorted(grads) == ["s0/backward/mlp.down/param_grad#0/bias", "s0/backward/mlp.down/param_grad#0/weight",
                             "s0/backward/mlp.up/param_grad#0/bias", "s0/backward/mlp.up/param_grad#0/weight"], grads
    assert any("oracle" in k and k.endswith(".c0") for k in keys) and any("oracle" in k and k.endswith(".c1") for k in keys)
    plain_d = dict(plain)
    assert sorted(keys) == sorted(plain_d)
    wrong = [k for k, t in ckpt if not torch.equal(t, plain_d[k])]
    assert not wrong, wrong


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return compare_planted(tmp_path_factory, {c: ("ckpt_twice", c, ("--tp", "1,2")) for c in ("twice_ok", "twice_scaled")})


def test_a_correct_block_in_two_checkpoints_reads_rounding_and_a_planted_one_the_bug(runs):
    from tpdiag.diff.classes import leading_bug

    s, stdout, gate = runs["twice_ok"]
    assert s["class"] == "rounding" and not s["degrees"]["2"].get("findings"), s["degrees"]["2"]
    assert gate == 1, stdout
    s, stdout, gate = runs["twice_scaled"]
    lead = leading_bug(s["degrees"]["2"])
    assert lead is not None and (lead["module"], lead["cause"]) == ("mlp", "sharding-bug"), lead
    assert gate == 4, stdout
