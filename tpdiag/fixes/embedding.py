"""Grad accumulation for embeddings (kernels/grad_carry.py): inside an open window, with
invariant-gemm on, an nn.Embedding's lookup goes through EmbeddingCarry, whose weight grad is
added into the window's fp32 carry token by token instead of summed per micro-batch in the
param dtype and added piece by piece. Outside a window the module's own forward runs (stock).

Covered: a plain embedding (TP=1) and a vocab-parallel one (a DTensor weight Shard(0) in even
shards): under torch's RowwiseParallel the partial output goes back as a Partial DTensor (the
style all-reduces it); under transformers' embedding style (its own forward, plain tensors) it
is all-reduced here, as that forward would.
Anything else (padding_idx, max_norm, scale_grad_by_freq, sparse, other placements) runs stock:
its grad is not carried.
"""
from __future__ import annotations

from contextlib import contextmanager

from torch import nn

from tpdiag.base.dtensors import local_of
from tpdiag.fixes import state
from tpdiag.kernels import grad_carry

FLAG = "invariant-gemm"


def _plain(mod: nn.Embedding) -> bool:
    return (mod.padding_idx is None and mod.max_norm is None and not mod.scale_grad_by_freq
            and not mod.sparse)


def _wrap(name: str, mod: nn.Embedding):
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    own = mod.__dict__.get("forward")
    orig = mod.forward

    def forward(ids, *args, **kwargs):
        w = mod.weight
        if args or kwargs or not (state.active(FLAG) and grad_carry.is_open()) or not w.requires_grad:
            return orig(ids, *args, **kwargs)
        offset, out, reduce = None, None, False
        if isinstance(w, DTensor):
            mesh, pl = w.device_mesh, tuple(w.placements)
            if pl == (Shard(0),) and w.shape[0] % mesh.size() == 0:
                offset = mesh.get_local_rank() * (w.shape[0] // mesh.size())
                # torch's style made the input a DTensor and all-reduces a Partial output itself;
                # transformers' (its own forward, plain tensors) hands on the all-reduced rows
                out, reduce = ([Partial()], False) if isinstance(ids, DTensor) else (None, True)
            elif pl == (Replicate(),):
                # a replicated weight: a DTensor out only where the input came as one (a style's
                # hook made it so); transformers' unplanned embed_tokens hands on plain tensors
                out = [Replicate()] if isinstance(ids, DTensor) else None
            else:
                return orig(ids, *args, **kwargs)
        from tpdiag.kernels.carry_functions import EmbeddingCarry

        y = EmbeddingCarry.apply(local_of(ids), local_of(w), offset,
                                 grad_carry.site(w, f"{name}.weight"))
        if reduce:  # one rank's row plus zeros: exact in any order (backward: the grad as is)
            from tpdiag.kernels.tree import tree_all_reduce

            return tree_all_reduce(y, y.dtype)
        return DTensor.from_local(y, w.device_mesh, out, run_check=False) if out else y

    mod.forward = forward
    return own


@contextmanager
def embedding_carry(model: nn.Module):
    """Wrap every plain nn.Embedding of `model` until the block ends (restored in finally)."""
    saved = []
    try:
        for name, mod in model.named_modules():
            if isinstance(mod, nn.Embedding) and _plain(mod):
                saved.append((mod, _wrap(name, mod)))
        yield
    finally:
        for mod, own in saved:
            if own is not None:
                mod.forward = own
            else:
                mod.__dict__.pop("forward", None)
