"""`tpdiag.clip_grad_norm_` under the switch clips as torch.nn.utils.clip_grad_norm_ does: the
coefficient min(max_norm / (norm + 1e-6), 1) from the invariant norm, in torch's norm dtype. On an
unsharded model, wherever the invariant norm (rounded to that dtype) equals torch's, the scaled
grads are torch's bit for bit. (TP=1 vs TP=2 of the same clip: test_public_api.py's torchrun run.)
"""
from __future__ import annotations

import pytest
import torch
from torch import nn


def _model(dtype):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 16)).to(dtype)
    return m, {"0": "colwise", "2": "rowwise"}


def _grads(model, seed: int, scale: float):
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = (torch.randn(p.shape, generator=g) * scale).to(p.dtype)


def _bits(t):
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scaled_grads_are_torchs_bit_for_bit_where_the_norms_agree(dtype):
    import tpdiag

    model, plan = _model(dtype)
    same, clipped = 0, 0
    with tpdiag.invariant(model, plan, fixes="all", tree_groups=2):
        for seed in range(12):
            # norms from ~0.4 to ~15 against max_norm 1.0: most clip, by coefficients that are
            # not powers of two, some do not
            _grads(model, seed, 0.02 * (seed + 1))
            before = [p.grad.clone() for p in model.parameters()]
            ref = [nn.Parameter(p.detach().clone()) for p in model.parameters()]
            for r, b in zip(ref, before):
                r.grad = b.clone()
            want = torch.nn.utils.clip_grad_norm_(ref, 1.0)
            got = tpdiag.clip_grad_norm_(model.parameters(), 1.0)
            assert got.dtype == torch.float64
            if not torch.equal(got.to(want.dtype), want):
                continue  # torch's own norm rounded elsewhere: its coefficient may differ by an ulp
            same += 1
            for p, r in zip(model.parameters(), ref):
                assert torch.equal(_bits(p.grad), _bits(r.grad)), (seed, float(want))
            if float(want) > 1.0:
                clipped += 1
                # really scaled, and not by a power of two (the old coefficient): 1/norm
                coef = 1.0 / (float(want) + 1e-6)
                assert not torch.equal(p.grad, before[-1])
                assert abs(coef - 2.0 ** round(torch.tensor(coef).log2().item())) > 1e-3 * coef
    assert same >= 8 and clipped >= 4, (same, clipped)


def test_the_coefficient_stays_on_the_device_no_host_sync(monkeypatch):
    """No .item()/float() of the norm: the clip must not make the host wait for the GPU."""
    import tpdiag

    model, plan = _model(torch.float32)
    _grads(model, 0, 1.0)
    calls = []
    for name in ("item", "__float__", "__bool__", "tolist"):
        orig = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name,
                            lambda self, *a, _n=name, _o=orig, **k: calls.append(_n) or _o(self, *a, **k))
    with tpdiag.invariant(model, plan, fixes="all", tree_groups=2):
        tpdiag.clip_grad_norm_(model.parameters(), 1.0)
    assert calls == [], calls
