"""probes/op_probe.written: an op output's rows past what the kernel wrote are not recorded.
Memory-efficient attention (CUDA) allocates its log-sum-exp with the query rows rounded up to 32
per head and writes only the first L: recorded whole, two sides held different garbage there and a
correct float32 model with 8 positions read `non-finite` at `_scaled_dot_product_efficient_attention#0.1`
(2x H200). Here on the host: the op's outputs as it returns them, garbage included."""
import torch

from tpdiag.probes.op_probe import written


def _lse(garbage: float):
    t = torch.full((2, 4, 32), garbage)
    t[..., :8] = torch.arange(2 * 4 * 8, dtype=torch.float32).reshape(2, 4, 8) / 7
    return t


def test_efficient_attention_lse_is_recorded_for_the_query_rows_only():
    q = torch.zeros(2, 4, 8, 16)  # [B, H, L, E]
    a, b = _lse(float("inf")), _lse(float("nan"))
    # negative control: whole, the two sides differ (and hold non-finite values) past row 8
    assert not torch.equal(a, b)
    wa = written("_scaled_dot_product_efficient_attention", 1, a, (q, q, q))
    wb = written("_scaled_dot_product_efficient_attention", 1, b, (q, q, q))
    assert wa.shape == (2, 4, 8) and torch.equal(wa, wb) and torch.isfinite(wa).all()
    assert torch.equal(wa, a[..., :8])
    # the lower-level op: query [B, M, H, K]
    q2 = torch.zeros(2, 8, 4, 16)
    args = (q2, q2, q2, None, None, None, None, None, 0.0, 1, True)
    assert torch.equal(written("_efficient_attention_forward", 1, a, args), a[..., :8])


def test_other_outputs_and_ops_are_recorded_whole():
    q = torch.zeros(2, 4, 8, 16)
    a = _lse(float("inf"))
    assert written("_scaled_dot_product_efficient_attention", 0, a, (q,)) is a  # the attention output
    assert written("_scaled_dot_product_flash_attention", 1, a, (q,)) is a  # its lse is [B, H, L] already
    assert written("mm", 1, a, (q,)) is a
    full = torch.zeros(2, 4, 8)
    assert written("_scaled_dot_product_efficient_attention", 1, full, (q,)) is full  # nothing past L
