"""tiny-llama whose CPU attention kernel is made head-count dependent on purpose (a planted bug
that stands in for a GPU flash kernel): aten::_scaled_dot_product_flash_attention_for_cpu is
replaced, for this process, by a kernel that sums P @ V over key chunks of S // heads keys, so
TP=2 (half the heads per call) sums in another order than TP=1. F.scaled_dot_product_attention
still reaches it the stock way; `--fix invariant-attention` intercepts F.sdpa above it."""
import math

import torch

import tpdiag
from tpdiag.models import tiny_llama
from tpdiag.models.plans import llama_plan

_LIB = None


def planted_sdpa(query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    B, H, L, D = query.shape
    S = key.shape[2]
    sc = scale if scale is not None else 1.0 / math.sqrt(D)
    q, k, v = (t.to(torch.float32) for t in (query, key, value))
    s = torch.matmul(q, k.transpose(-1, -2)) * sc
    if is_causal:
        s = s.masked_fill(~torch.ones(L, S, dtype=torch.bool).tril(), float("-inf"))
    m = s.amax(dim=-1, keepdim=True)
    p = torch.exp(s - m)
    chunk = max(1, S // H)  # the planted dependence on the heads per call
    num = torch.zeros(B, H, L, v.shape[-1])
    den = torch.zeros(B, H, L, 1)
    for c in range(0, S, chunk):
        num = num + torch.matmul(p[..., c:c + chunk], v[:, :, c:c + chunk])
        den = den + p[..., c:c + chunk].sum(dim=-1, keepdim=True)
    out = (num / den).to(query.dtype)
    return out, (m + torch.log(den)).squeeze(-1)


def install():
    global _LIB
    if _LIB is None:
        _LIB = torch.library.Library("aten", "IMPL")
        _LIB.impl("_scaled_dot_product_flash_attention_for_cpu", planted_sdpa, "CPU")


def target():
    install()
    model = tiny_llama.build("tiny-llama", n_layers=1)
    return tpdiag.Target(model=model, plan=llama_plan(), vocab_size=model.cfg.vocab_size)
