"""The step's optimizer (runner/update.optimizer): AdamW whose eps is at least the smallest normal of each
parameter's dtype. In float16 torch's AdamW with eps 1e-8 (0 in float16) divides a zero second moment by
zero - a grad element of 0, or one whose (1 - beta2) g^2 underflows - and writes NaN / Inf into the
weights at every degree (tests/test_tied_vocab.py: the correct tied_ok read NON-FINITE at its first
optimizer step in float16). float32 and bfloat16 keep the stock update, bit for bit."""
import torch

from tpdiag.runner.update import optimizer

# 0, a grad whose square underflows float16, one that does not
GRADS = [0.0, 1e-3, 1e-5, 0.1]


def _model(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    m = torch.nn.Linear(4, 4).to(dtype)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g).to(dtype))
    return m


def _step(m, opt, dtype):
    for p in m.parameters():
        p.grad = torch.tensor(GRADS * (p.numel() // len(GRADS)), dtype=dtype).reshape(p.shape)
    opt.step()


def test_float16_update_stays_finite_where_stock_adamw_does_not():
    m = _model(torch.float16)
    _step(m, optimizer(m, 1e-2), torch.float16)
    assert all(torch.isfinite(p).all() for p in m.parameters()), list(m.parameters())
    # the control: the stock optimizer on the same weights and grads is what wrote NaN / Inf
    c = _model(torch.float16)
    _step(c, torch.optim.AdamW(c.parameters(), lr=1e-2, foreach=False), torch.float16)
    assert not all(torch.isfinite(p).all() for p in c.parameters())


def test_float32_and_bfloat16_keep_the_stock_update_bitwise():
    for dtype in (torch.float32, torch.bfloat16):
        a, b = _model(dtype), _model(dtype)
        _step(a, optimizer(a, 1e-2), dtype)
        _step(b, torch.optim.AdamW(b.parameters(), lr=1e-2, foreach=False), dtype)
        for p, q in zip(a.parameters(), b.parameters()):
            assert torch.equal(p, q), dtype


def test_each_dtype_its_own_eps():
    m = torch.nn.ModuleDict({"a": torch.nn.Linear(2, 2).half(), "b": torch.nn.Linear(2, 2)})
    eps = {g["params"][0].dtype: g["eps"] for g in optimizer(m, 1e-2).param_groups}
    assert eps == {torch.float16: torch.finfo(torch.float16).tiny, torch.float32: 1e-8}, eps
