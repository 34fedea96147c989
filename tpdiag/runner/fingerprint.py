"""What one step computed, in a few hashes: the final logits, logprobs, loss and grad norm and
every updated parameter, per rank (local shards). The first pass proves its probes change
nothing by rerunning the step unprobed (the self-check); the region pass, which probes a few
modules with full capture, instead shows its step computed the same numbers as the first
pass's at the same degree - same fingerprint - and so saves an unprobed step per world."""
from __future__ import annotations

import hashlib

import torch


def step_fingerprint(final: dict, model) -> dict[str, str]:
    """{name: hash} of `final`'s tensors (None skipped) and one hash over every parameter."""
    from tpdiag.base.dtensors import local_of
    from tpdiag.records.hashing import tensor_hash

    out = {k: tensor_hash(local_of(v).detach()) for k, v in final.items() if isinstance(v, torch.Tensor)}
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(f"{name}:{tensor_hash(local_of(p).detach())}\n".encode())
    out["params"] = h.hexdigest()[:16]
    return out


def first_difference(a: list | None, b: list | None) -> str | None:
    """None when two worlds' per-rank fingerprints are equal; else where they first differ."""
    if not a or not b or len(a) != len(b):
        return "no fingerprint to compare" if not a or not b else f"{len(a)} ranks against {len(b)}"
    for rank, (fa, fb) in enumerate(zip(a, b)):
        if not fa or not fb:
            return f"rank {rank}: no fingerprint"
        for k in sorted(set(fa) | set(fb)):
            if fa.get(k) != fb.get(k):
                return f"rank {rank}: {k}"
    return None
