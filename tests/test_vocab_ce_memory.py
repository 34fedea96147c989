"""invariant-vocab-softmax without fp32 copies of the logits (issue #43: the MoE fix run doubled
its peak memory; a 151936-wide vocab at 8 x 4096 tokens is 18.6 GiB per fp32 copy).

The function saves the logits as they are and rebuilds the grad a few token rows at a time. Its
numbers must be the whole-tensor fp32 formula's, bit for bit: log p = l[label] - (m + log sum
exp(l - m)) over fixed vocab groups, grad = g * (onehot - exp(l - lse)) rounded once."""
import pytest
import torch

from tpdiag.kernels import vocab_ce
from tpdiag.kernels.tree import tree_sum

T, V, G = 37, 96, 4


def whole_formula(logits, labels, g, groups):
    """The formula on one fp32 copy of the whole logits (what the function computed before)."""
    l = logits.float()
    m = l.max(dim=-1).values
    e = torch.exp(l - m[:, None])
    s = tree_sum([eg.contiguous().sum(dim=-1) for eg in e.chunk(groups, dim=-1)])
    lse = m + torch.log(s)
    valid = labels != vocab_ce.IGNORE
    idx = torch.where(valid, labels, torch.zeros_like(labels))
    tgt = torch.where(valid, l.gather(-1, idx[:, None]).squeeze(-1), torch.zeros_like(lse))
    lp = torch.where(valid, tgt - lse, torch.zeros_like(lse))
    gg = torch.where(valid, g, torch.zeros_like(g))
    onehot = torch.zeros_like(l)
    onehot.scatter_(-1, idx[:, None], valid[:, None].float())
    return lp, (gg[:, None] * (onehot - torch.exp(l - lse[:, None]))).to(logits.dtype)


def bits(t):
    return t.contiguous().view(-1).view(torch.int16 if t.element_size() == 2 else torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vocab_logprob_is_the_whole_fp32_formula_bitwise_and_saves_no_fp32_copy(dtype, monkeypatch):
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(T, V, generator=gen) * 4).to(dtype)
    logits[3, 5] = 30.0  # a dominant logit: p near 1 at its label, exp underflow elsewhere
    labels = torch.randint(0, V, (T,), generator=gen)
    labels[3] = 5
    labels[[0, 7]] = vocab_ce.IGNORE
    g = torch.randn(T, generator=gen)
    monkeypatch.setattr(vocab_ce, "CHUNK_ELEMENTS", 5 * V, raising=False)  # several backward chunks, one ragged

    saved = []
    x = logits.clone().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        lp = vocab_ce.VocabParallelLogProb.apply(x, labels, G)
    lp.backward(g)
    ref_lp, ref_grad = whole_formula(logits, labels, g, G)
    assert torch.equal(bits(lp), bits(ref_lp))
    assert x.grad.dtype == dtype and torch.equal(bits(x.grad), bits(ref_grad))
    big = [t for t in saved if t.numel() == T * V]
    assert big and all(t.dtype == dtype for t in big), [(t.dtype, tuple(t.shape)) for t in saved]
    if dtype == torch.bfloat16:  # the 16-bit logits are the tensor itself, not a copy
        assert any(t.data_ptr() == x.data_ptr() for t in big)
