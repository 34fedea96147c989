"""One build per world: the unprobed self-check run and the probed run start from the same bits,
the build's state put back between them (runner/pristine.py), not a second build. The restore
is exact - every parameter, buffer and plain tensor attribute, no grads, the RNG as the build
left it - and where it cannot be (an attribute the run set, a tensor it replaced) the probed run
builds its own. Negative controls: a restore that misses the buffers, or that ignores an
attribute the run set, fails the self-check of a model whose step reads that state; a build
that is not reproducible is caught by the reference rerun."""
import json

import pytest
import torch

from conftest import run_cli
from tpdiag.runner.pristine import Pristine

MODELS = "tests/models/stateful.py"


def _model(kind):
    import importlib.util

    spec = importlib.util.spec_from_file_location("stateful", MODELS)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    torch.manual_seed(0)
    return getattr(mod, kind)().model


def _bits(model) -> dict:
    out = dict(model.named_parameters(remove_duplicate=False))
    out.update(model.named_buffers(remove_duplicate=False))
    return {k: v.detach().clone() for k, v in out.items()}


def _step(model) -> None:
    """What a run leaves behind: grads, an optimizer step, buffers moved, RNG drawn from."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    ids = torch.randint(0, model.cfg.vocab_size, (2, 8))
    model(ids).float().sum().backward()
    opt.step()
    torch.randn(3)


def test_restore_puts_back_every_tensor_and_the_rng():
    model = _model("counting")
    before, rng = _bits(model), torch.get_rng_state()
    kept = Pristine.take(model)
    _step(model)
    assert int(model.calls) == 1 and any(p.grad is not None for p in model.parameters())
    assert any(not torch.equal(before[k], v) for k, v in _bits(model).items())
    assert kept.restore() is None
    after = _bits(model)
    assert before.keys() == after.keys()
    for k, v in before.items():  # raw bits (NaN payloads, -0.0) as well as values
        assert torch.equal(v.view(torch.int32), after[k].view(torch.int32)), k
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), rng)


def test_restore_refuses_what_it_cannot_put_back():
    model = _model("lazy")
    kept = Pristine.take(model)
    _step(model)  # sets model._warm
    why = kept.restore()
    assert why and "_warm" in why, why
    # a parameter replaced, a buffer registered: refused too
    model = _model("counting")
    kept = Pristine.take(model)
    model.norm.weight = torch.nn.Parameter(model.norm.weight.detach().clone())
    assert "<params>" in kept.restore()
    model = _model("counting")
    kept = Pristine.take(model)
    model.norm.register_buffer("extra", torch.zeros(1))
    assert "<buffers>" in kept.restore()


def _compare(tmp_path, name, target, *args, env=None, code=0):
    out = tmp_path / name
    p = run_cli("compare", "--model", f"py:{MODELS}:{target}", "--out", str(out), "--format", "json",
                "--no-confirm", "--no-judge-downstream", *args, env=env)
    assert p.returncode == code, p.stdout + p.stderr
    return json.loads(p.stdout), out


def _world(out, label) -> dict:
    return json.loads((out / f"tp{label}" / "world.json").read_text())


def test_one_build_per_world_and_the_selfcheck_still_bites(tmp_path):
    """A buffer the step moves (a call counter that scales the logits): restored, both runs of
    each world agree - at TP=2 too, where the parameters are DTensors; without the buffers'
    restore (the negative control) the probed run starts from the moved counter and the
    self-check fails."""
    s, out = _compare(tmp_path, "ok", "counting", "--tp", "1,2", "--no-baseline")
    for label in ("1", "2"):
        w = _world(out, label)
        assert w["probe_selfcheck"]["equal"] is True and w["probe_selfcheck"]["checked"] > 10
        assert "selfcheck_rebuilt" not in w["timings"], w["timings"]  # restored, not rebuilt
    s, out = _compare(tmp_path, "bad", "counting", "--tp", "1,2", "--no-baseline", code=2,
                      env={"TPDIAG_TEST_RESTORE_SKIP": "buffers"})
    assert s["status"] == "inconclusive"
    assert _world(out, "1")["probe_selfcheck"]["equal"] is False


def test_state_the_restore_cannot_put_back_means_a_rebuild(tmp_path):
    """An attribute the step sets (a lazily made flag that scales the logits once set): the
    probed run builds its own model, and says why; without that check (the negative control)
    it would start from the flag the unprobed run set, and the self-check fails."""
    s, out = _compare(tmp_path, "ok", "lazy", "--tp", "1,1", "--no-baseline", "--forward-only")
    w = _world(out, "1")
    assert w["probe_selfcheck"]["equal"] is True
    assert "_warm" in w["timings"]["selfcheck_rebuilt"]
    s, out = _compare(tmp_path, "bad", "lazy", "--tp", "1,1", "--no-baseline", "--forward-only", code=2,
                      env={"TPDIAG_TEST_RESTORE_SKIP": "attributes"})
    assert _world(out, "1")["probe_selfcheck"]["equal"] is False


def test_a_build_that_is_not_reproducible_is_caught(tmp_path):
    """os.urandom noise in the init: one build per world, so the world's own runs agree; the
    reference rerun (another build) does not reproduce the reference's initial parameters."""
    s, out = _compare(tmp_path, "r", "unreproducible", "--tp", "1,2", code=2)
    assert s["status"] == "inconclusive" and s["baseline"]["reproducible"] is False
    fd = s["baseline"]["first_divergence"]
    assert (fd["phase"], fd["module"]) == ("init", "layers.0.ffn_norm"), fd
