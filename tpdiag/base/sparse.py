"""A sparse tensor (nn.Embedding(sparse=True)'s grad: COO indices and values) as its strided
equivalent, for records, norms and float64 copies that read strided tensors."""
from __future__ import annotations

import torch


def layout_name(t) -> str | None:
    """'sparse_coo' (or another sparse layout's name) for a sparse tensor, None for a strided one."""
    lay = getattr(t, "layout", torch.strided)
    return None if lay is torch.strided else str(lay).removeprefix("torch.")


def strided(t):
    """t itself where strided; else the dense tensor it stands for. A COO grad's indices repeat
    where a token does: it is coalesced first, the repeated rows summed as SparseAdam's own
    `grad.coalesce()` sums them, so the record holds the rounding of the grad that optimizer reads
    (to_dense of the uncoalesced one sums them its own way)."""
    lay = getattr(t, "layout", torch.strided)
    if lay is torch.strided:
        return t
    if lay is torch.sparse_coo:
        t = t.coalesce()
    return t.to_dense()


def densify_grads(params) -> None:
    """`compare`'s own step (its grad norm, clip and AdamW read strided grads: AdamW refuses a sparse
    one) on each sparse grad's dense equivalent, put in its .grad."""
    for p in params:
        if p.grad is not None and layout_name(p.grad) is not None:
            p.grad = strided(p.grad)
