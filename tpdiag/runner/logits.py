"""Logits that come back as unmarked local vocab shards, made whole for tpdiag's own numerics.

torch's `ColwiseParallel()` defaults to `use_local_output=True`: each rank's head returns its
plain local slice of the vocab, with nothing saying so. tpdiag's logprobs, loss and records need
the whole vocab, so such a shard is re-marked as a vocab-sharded DTensor (`from_local`, no copy,
no collective: the same bits, now with their placement) - read from the plan's style for the
module that produced them, else from the shape (local vocab x TP = the model's vocab). A user
loss still receives the plain local shard it was written for.
"""
from __future__ import annotations

import fnmatch

import torch


def _head_of(model, plan: dict, vocab: int):
    """(module name, mesh) of a plan entry that leaves vocab-sharded plain outputs: a
    ColwiseParallel with use_local_output and a Shard(-1) output over a weight of `vocab` rows."""
    from torch.distributed.tensor import DTensor

    for name, mod in model.named_modules():
        style = next((s for p, s in plan.items() if fnmatch.fnmatchcase(name, p)), None)
        if style is None or type(style).__name__ != "ColwiseParallel":
            continue
        if not getattr(style, "use_local_output", False):
            continue
        out = getattr(style, "output_layouts", None)
        out = out[0] if isinstance(out, tuple) and out else out
        if out is None or not out.is_shard() or out.dim not in (-1,):
            continue
        w = getattr(mod, "weight", None)
        if isinstance(w, DTensor) and w.shape[0] == vocab:
            return name, w.device_mesh
    return None, None


def _any_mesh(model):
    from torch.distributed.tensor import DTensor

    return next((p.device_mesh for p in model.parameters() if isinstance(p, DTensor)), None)


_MESH: dict = {}  # device type -> (the default group it was made for, its mesh): one per world


def _world_mesh(device_type: str):
    """The world's 1-D mesh (tpdiag's world is one TP group), for a model that holds no DTensor:
    Megatron-style layers written by hand, each rank keeping its plain shard. Made once per
    default group (a decode world asks at every call)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    group = dist.group.WORLD
    hit = _MESH.get(device_type)
    if hit is None or hit[0] is not group:
        hit = _MESH[device_type] = (group, DeviceMesh.from_group(group, device_type))
    return hit[1]


def vocab_sharded(logits) -> bool:
    """Whether the logits are a DTensor cut along the vocab (their last dim): what torch's
    loss_parallel() is for (runner/losses.loss_context). It refuses any other DTensor in its
    log-softmax: a head under `ColwiseParallel(output_layouts=Replicate(), use_local_output=False)`
    failed every TP=2 rank in tpdiag's own logprobs (tests/models/user_tt25.py head_replicated)."""
    from torch.distributed.tensor import DTensor, Shard

    return isinstance(logits, DTensor) and any(
        isinstance(p, Shard) and p.dim % logits.ndim == logits.ndim - 1 for p in logits.placements)


def whole_vocab(logits, model, plan: dict, vocab: int, world: int):
    """(logits for tpdiag, rule): `logits` as a vocab-sharded DTensor when they are a plain
    local shard of the vocab (rule 'plan:<module>' or 'shape'), else unchanged (rule None).
    A shard of a vocabulary padded to a multiple of TP (Megatron's `make_vocab_size_divisible_by`:
    ceil(V/TP) rows per rank, the padding at the end) is gathered and its padding cut (rule
    'padded'): the padding's ids are no tokens, and TP=1 has none of them - counted in tpdiag's
    log-softmax, every logprob would differ with TP, the user's correct code as much as a
    mistake (tests/models/planted/tp_gathers.py vocab_pad_ok)."""
    from torch.distributed.tensor import DTensor

    if isinstance(logits, DTensor) and not vocab_sharded(logits):
        # every vocab entry on every rank (replicated, or cut along the sequence): whole, as a plain
        # tensor - tpdiag's logprobs are no DTensor op's; a Target.loss still gets the DTensor
        return logits.full_tensor(), "dtensor"
    if type(logits) is not torch.Tensor or logits.ndim < 2:
        return logits, None
    n = logits.shape[-1]
    if world <= 1:
        # Megatron pads at TP=1 too (to a multiple of 128 by default): the rows past the real vocab
        # are no tokens, and the padded size differs with TP - counted, every logprob would differ
        return (logits[..., :vocab], "padded") if n > vocab else (logits, None)
    from tpdiag.records.layout import padded_dim

    # padding of less than a shard (ceil(V/TP) rows per rank), or Megatron's default: the vocab
    # padded to a multiple of 128 * TP, so a rank may hold padding only (100 ids: 128 rows each)
    padded = padded_dim([n], [vocab], world) == 0 or (n * world > vocab and n != vocab)
    if n == vocab or (n * world != vocab and not padded):
        return logits, None
    name, mesh = _head_of(model, plan or {}, vocab)
    rule = f"plan:{name}" if name is not None else "shape"
    if mesh is None:
        mesh = _any_mesh(model) or _world_mesh(logits.device.type)
    from torch.distributed.tensor import DTensor, Shard

    # the rank order of the mesh is the vocab order of ColwiseParallel's weight shards
    whole = DTensor.from_local(logits, mesh, [Shard(logits.ndim - 1)], run_check=False)
    if padded:
        # one all-gather; its backward hands each rank its own columns of the grad
        full = whole.full_tensor()
        if n > vocab and all(torch.equal(c[..., :vocab], full[..., :vocab]) for c in full.split(n, -1)[1:]):
            # every rank holds the same logits of the real ids (a gathered head): a replica, not
            # shards - whatever its padding holds, which is no token and may differ per rank (each
            # rank masking only its own range's padding); read as shards, rank 0's columns would
            # be every rank's logits and the other ranks' logit grads zero: a false BUG at the head
            return logits[..., :vocab], "padded"
        return full[..., :vocab], "padded"
    return whole, rule


def logits_of(out):
    """The logits in a model's output: the tensor itself, `.logits` (transformers), or the first
    item of a tuple."""
    if isinstance(out, torch.Tensor):
        return out
    if hasattr(out, "logits"):
        return out.logits
    if isinstance(out, (tuple, list)):
        return out[0]
    raise TypeError(f"cannot find logits in model output of type {type(out).__name__}")


def check_positions(logits, labels, world: int) -> None:
    """Refuse, in one line, logits that do not cover the batch's positions - what
    F.cross_entropy would refuse anyway, in its words ("Expected input batch_size (8) to match
    target batch_size (16)"), from inside tpdiag's logprobs: logits a sequence- or context-
    parallel model left on each rank's positions."""
    n = 1
    for d in logits.shape[:-1]:
        n *= int(d)
    if n == labels.numel():
        return
    from tpdiag.errors import BadInput

    shape, want = tuple(logits.shape), tuple(labels.shape)
    sharded = ""
    if n * world == labels.numel():
        sharded = f" ({n * world} over the {world} ranks: each rank's own positions?)"
    raise BadInput(f"the model returned logits of shape {shape}, {n} positions{sharded}, for labels of shape "
                   f"{want}: tpdiag reads the logits of every position of the batch on every rank - gather "
                   "sequence- or context-parallel logits before the model returns them")
