"""SdpaRan (which SDPA backend ran) must leave a torch.compile'd forward's graph as the user's:
rollout --padding compiled reproduces generate()'s compiled static decode only if the wrapper adds
no graph break (on an H200 the broken graph's kernels matched none of an engine's sequences;
tests/test_rollout_gpu.py). fullgraph=True fails on any break: with the wrapper tracing its
backend question and count, it raised; now it traces to the call alone."""
import torch
import torch.nn.functional as F

from tpdiag.runner.sdpa_ran import SdpaRan


def _attn(q, k, v):
    # looked up at call time, as transformers' sdpa_attention does
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True) * 2


def test_sdpa_ran_adds_no_graph_break_under_compile():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 8) for _ in range(3))
    torch._dynamo.reset()
    f = torch.compile(_attn, backend="eager", fullgraph=True)
    with SdpaRan() as ran:
        got = f(q, k, v)
        eager = _attn(q, k, v)
    assert torch.equal(got, F.scaled_dot_product_attention(q, k, v, is_causal=True) * 2)
    assert torch.equal(got, eager)
    # the eager call is counted; the compiled one is inductor's/dynamo's, not asked about
    assert sum(ran.counts.values()) == 1, ran.counts
    torch._dynamo.reset()
