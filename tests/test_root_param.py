"""A parameter the root owns itself in an HF-layout model (tests/models/planted/root_param.py: the body as
`model`, the head as `lm_head`, a per-channel output scale on the root), helper hreview18.

Since RECORD_FORMAT 3 the root records as "(root)" beside its `model` child; at 00909fb its own parameters
still recorded under "model" (model_walk.record_params, module_probe's grad hooks): the root's float64
backward, recorded under "(root)", judged no such grad and the body's has none, so scale_f (the scale sent
through Megatron's f: its grad, whole on every rank, summed over the ranks - 2x at TP=2) was listed as
not judged (class unknown, gate 1; at 85e6ea9 it read `rounding only`, gate 0). The root's own
parameters record under the root's record name now: the root's backward judges the grad, BUG
(sharding-bug) at (root), gate 4. The twin stays rounding."""
import json

from conftest import run_cli

SPEC = "py:tests/models/planted/root_param.py:"
GRAD = "s0/backward/(root)/param_grad#0/out_scale"


def _run(tmp_path, case):
    d = tmp_path / case
    p = run_cli("compare", "--model", SPEC + case, "--tp", "1,2", "--no-baseline", "--no-confirm", "--out", str(d),
                env={"OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-3000:] + p.stdout[-2000:]
    g = run_cli("gate", str(d), "--allow", "rounding")
    return json.loads((d / "summary.json").read_text()), p.stdout, g


def test_root_owned_scale_grad_summed_over_ranks_is_a_bug_at_the_root(tmp_path):
    from tpdiag.records.causes import cause_class

    s, out, g = _run(tmp_path, "scale_f")
    e = s["degrees"]["2"]
    assert s["class"] == "bug" and e["class"] == "bug", (s["class"], e.get("not_judged"), out[-2000:])
    f = next((f for f in e.get("findings") or () if f.get("key") == GRAD), None)
    assert f is not None and f["cause"] == "sharding-bug" and f["module"] == "(root)", e.get("findings")
    # judged by the root's float64 backward (its own parameter's grad), far beyond rounding
    assert f["oracle"]["far"] and f["oracle"]["ratio"] > 1e3, f["oracle"]
    assert not e.get("not_judged"), e.get("not_judged")
    # no record of the body child `model` holds the root's parameter
    assert "s0/backward/model/param_grad#0/out_scale" not in out
    assert "BUG at backward: out_scale (param_grad; a parameter of the root module)" in out, out[-2000:]
    assert cause_class(f["cause"]) == "bug"
    both = g.stdout + g.stderr
    assert g.returncode == 4 and "module (root)" in both and "record param_grad out_scale" in both, both[-2000:]


def test_root_owned_scale_used_as_is_is_rounding(tmp_path):
    s, out, g = _run(tmp_path, "scale_ok")
    e = s["degrees"]["2"]
    assert s["class"] == "rounding" and not e.get("not_judged") and not e.get("findings"), e
    assert g.returncode == 0, (g.stdout + g.stderr)[-2000:]


def test_the_roots_own_parameter_and_buffer_record_under_the_roots_name():
    """No world: an HF-layout root's own parameter and the buffer its forward writes record under
    "(root)" - the name its float64 re-execution's records carry (diff/oracle.target_key maps the
    root's buffer oracle there) - while its `model` child's own parameter keeps "model". A root with no
    child named `model` keeps "model" for its own."""
    import torch
    from torch import nn

    from tpdiag.diff.oracle import target_key
    from tpdiag.probes.model_walk import buffer_state, record_params, record_written_buffers
    from tpdiag.probes.module_probe import module_probes
    from tpdiag.probes.recorder import Recorder

    class Body(nn.Module):
        def __init__(self):
            super().__init__()
            self.gain = nn.Parameter(torch.ones(4))
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x) * self.gain

    class CausalLM(nn.Module):
        def __init__(self, child):
            super().__init__()
            setattr(self, child, Body())
            self.child = child
            self.out_scale = nn.Parameter(torch.full((4,), 2.0))
            self.register_buffer("amax", torch.zeros(4))

        def forward(self, x):
            y = getattr(self, self.child)(x) * self.out_scale
            with torch.no_grad():
                self.amax.copy_(y.abs().amax(0))
            return y

    for child, root in (("model", "(root)"), ("body", "model")):
        m, x = CausalLM(child), torch.randn(3, 4)
        rec = Recorder(mode="full")
        before = buffer_state(m)
        with module_probes(m, rec, oracle={root}):
            m(x).sum().backward()
            record_params(rec, m, "param")
        record_written_buffers(rec, m, before)
        keys = {meta["key"] for meta, _ in rec.records}
        mine = {(meta["module"], meta["kind"], meta["name"]) for meta, _ in rec.records
                if meta["kind"] in ("param", "param_grad", "buffer")}
        assert mine == {(root, "param_grad", "out_scale"), (root, "param", "out_scale"), (root, "buffer", "amax"),
                        (child, "param_grad", "gain"), (child, "param", "gain"),
                        *((f"{child}.lin", k, n) for k in ("param", "param_grad") for n in ("weight", "bias"))}, \
            (child, sorted(mine))
        # the root's float64 backward judges the grad recorded under its own name, and its buffer
        oracle = {target_key(k) for k in keys if f"/{root}/oracle#" in k}
        assert f"s0/backward/{root}/param_grad#0/out_scale" in oracle, sorted(oracle)
        assert f"s0/optimizer/{root}/buffer#0/amax" in oracle, sorted(oracle)
