"""`tpdiag.accumulate_grads` on a user's own GPT-2-style model (tests/user_gpt2_accum.py:
LayerNorm, biases, learned positions, GELU MLP, SDPA attention, tied and untied LM head) under
torchrun: one piece of 4 sequences and 4 pieces of one give bitwise equal grads (every parameter)
and grad norm, at TP=1 and TP=2, and TP=2 equals TP=1; no parameter is left uncarried (the
script makes a NotCarried warning an error). Without accumulate_grads (the same fixes) the two
splits differ - the negative control. And in-process: a LayerNorm left unwrapped is named in a
NotCarried warning and its grads differ across the splits (why LayerNorm needs the carry).
"""
from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from conftest import ROOT, run_module

SCRIPT = os.path.join(ROOT, "tests", "user_gpt2_accum.py")


def _torchrun(nproc: int, out, runs: str) -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    p = run_module("torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), SCRIPT, "--out", str(out),
                   "--runs", runs, env=env, cwd=ROOT, timeout=300)
    assert out.is_file(), p.stdout[-3000:] + p.stderr[-3000:]
    return load_file(str(out))


def _split(got: dict, prefix: str) -> dict:
    return {k[len(prefix):]: v for k, v in got.items() if k.startswith(prefix)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("gpt2")
    return {1: _torchrun(1, base / "tp1.safetensors", "carry,plain"),
            2: _torchrun(2, base / "tp2.safetensors", "carry")}


@pytest.mark.parametrize("head", ["tied", "untied"])
def test_gpt2_grads_are_bitwise_across_micro_batches_and_tp(runs, head):
    ref = _split(runs[1], f"carry/{head}/mb4/")
    assert len([k for k in ref if k.startswith("grad.")]) >= 36 and "grad_norm" in ref
    assert any(".ln_1.bias" in k for k in ref) and ("grad.lm_head.weight" in ref) == (head == "untied")
    for tp in (1, 2):
        for m in ("mb4", "mb1"):
            got = _split(runs[tp], f"carry/{head}/{m}/")
            assert sorted(got) == sorted(ref)
            bad = [k for k in ref if not torch.equal(got[k], ref[k])]
            assert bad == [], (tp, m, bad)
    # negative control: plain accumulation into .grad, the same fixes on
    plain4, plain1 = _split(runs[1], f"plain/{head}/mb4/"), _split(runs[1], f"plain/{head}/mb1/")
    differ = [k for k in plain4 if not torch.equal(plain4[k], plain1[k])]
    assert {"grad.h.0.ln_1.weight", "grad.ln_f.bias", "grad.h.1.fc.weight"} <= set(differ), differ
    # and the carried grads are the grads: close to the plain ones
    for k in ref:
        assert torch.allclose(ref[k], plain4[k], rtol=1e-4, atol=1e-6), k


def _ln_model():
    from torch import nn

    torch.manual_seed(0)

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.e, self.ln, self.head = nn.Embedding(16, 8), nn.LayerNorm(8), nn.Linear(8, 16)

        def forward(self, ids):
            return self.head(self.ln(self.e(ids)))

    return M()


def _ln_grads(micro: int):
    import tpdiag

    tpdiag.set_deterministic(seed=0, cpu_threads=1)
    m = _ln_model()
    g = torch.Generator().manual_seed(1)
    ids, labels = torch.randint(0, 16, (4, 8), generator=g), torch.randint(0, 16, (4, 8), generator=g)
    with tpdiag.invariant(m, {}, fixes="all", tree_groups=2), warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        with tpdiag.accumulate_grads(m):
            for a in range(0, 4, micro):
                F.cross_entropy(m(ids[a:a + micro]).flatten(0, 1), labels[a:a + micro].flatten(),
                                reduction="sum").backward()
    return {n: p.grad.clone() for n, p in m.named_parameters()}, [x.message for x in w]


def test_layernorm_is_carried_and_an_uncarried_one_is_named(monkeypatch):
    import tpdiag
    from tpdiag.fixes import norm

    (one, w1), (four, w4) = _ln_grads(4), _ln_grads(1)
    assert w1 == w4 == []
    assert all(torch.equal(one[k], four[k]) for k in one)
    # the LayerNorm left stock (as before the fix): its grads are named, and differ across splits
    monkeypatch.setattr(norm, "_ln_like", lambda mod: False)
    (one, w1), (four, w4) = _ln_grads(4), _ln_grads(1)
    assert len(w1) == 1 and isinstance(w1[0], tpdiag.NotCarried)
    assert "ln.weight, ln.bias" in str(w1[0]) and "head" not in str(w1[0]), str(w1[0])
    assert [k for k in one if not torch.equal(one[k], four[k])] == ["ln.weight", "ln.bias"]


def test_why_layernorm_differed_the_pieces_adding_not_the_kernels_row_order():
    """The cause the carry removes, on the CPU with one thread: torch's LayerNorm backward sums the
    rows it is given in an order that does not depend on how many there are (the same rows with
    zero-grad rows appended: the same bits), while four pieces' sums added one by one differ
    from one call over every row - the association the carry makes the same."""
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    n, d = 512, 64
    x, gy = torch.randn(n, d, generator=g), torch.randn(n, d, generator=g)
    w, b = torch.randn(d, generator=g), torch.randn(d, generator=g)
    _, mean, rstd = torch.native_layer_norm(x, (d,), w, b, 1e-5)

    def dwb(gg, rows):
        return torch.ops.aten.native_layer_norm_backward(gg[rows], x[rows], [d], mean[rows], rstd[rows],
                                                         w, b, [False, True, True])[1:]

    for m in (64, 128, 256):
        padded = gy.clone()
        padded[m:] = 0
        assert all(torch.equal(u, v) for u, v in zip(dwb(padded, slice(None)), dwb(gy, slice(0, m))))
    one = dwb(gy, slice(None))
    pieces = [dwb(gy, slice(i, i + n // 4)) for i in range(0, n, n // 4)]
    added = [pieces[0][0].clone(), pieces[0][1].clone()]
    for p in pieces[1:]:
        added[0] += p[0]
        added[1] += p[1]
    assert not torch.equal(added[0], one[0]) and torch.allclose(added[0], one[0], rtol=1e-4, atol=1e-4)
