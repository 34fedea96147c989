"""The step's batch: drawn the same on every rank and degree, and bound to the model's forward."""
from __future__ import annotations

import torch

from tpdiag.config import WorldConfig

IGNORE = -100


def make_batch(cfg: WorldConfig, target, device):
    """The same batch on every rank and degree: drawn from a generator seeded by cfg.seed.

    Returns (batch, labels); batch is a Tensor, a tuple (positional args) or a dict (keywords),
    as `Target.inputs` gave it (tokens only: a Tensor). `forward_call` binds it to the model."""
    g = torch.Generator().manual_seed(cfg.seed + 1)
    if target.inputs is not None:
        batch = target.inputs(g)
    else:
        batch = torch.randint(0, target.vocab_size, (cfg.batch_size, cfg.seq_len), generator=g)

    def move(v):
        return v.to(device) if isinstance(v, torch.Tensor) else v

    labels = None
    if isinstance(batch, dict):
        batch = {k: move(v) for k, v in batch.items()}
        labels = batch.pop("labels", None)
    elif isinstance(batch, (tuple, list)):
        batch = tuple(move(v) for v in batch)
    elif isinstance(batch, torch.Tensor):
        batch = move(batch)
    else:
        from tpdiag.errors import BadInput

        raise BadInput(f"Target.inputs returned {type(batch).__name__}; expected a Tensor (the "
                       "tokens), a tuple (positional args) or a dict (keywords, 'labels' optional)")
    if labels is None:
        ids = tokens_of(batch)
        # Next-token labels; the last position has none and is ignored.
        labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], IGNORE)], dim=1)
    return batch, labels


def tokens_of(batch) -> torch.Tensor:
    """The token ids in a batch: the Tensor itself, a dict's 'input_ids' (else its first
    tensor), a tuple's first tensor."""
    from tpdiag.errors import BadInput

    if isinstance(batch, torch.Tensor):
        cands = [batch]
    elif isinstance(batch, dict):
        cands = [batch["input_ids"]] if "input_ids" in batch else list(batch.values())
    else:
        cands = list(batch)
    ids = next((t for t in cands if isinstance(t, torch.Tensor)), None)
    if ids is None or ids.ndim < 2 or ids.is_floating_point():
        raise BadInput("Target.inputs gave no 'labels' and no [batch, seq] token tensor to derive "
                       "next-token labels from; return {'...': tokens, 'labels': labels}")
    return ids


def batch_items(batch) -> list[tuple[str, object]]:
    """(record name, value) per batch entry: a Tensor is 'input_ids', tuple items 'argI'."""
    if isinstance(batch, torch.Tensor):
        return [("input_ids", batch)]
    if isinstance(batch, dict):
        return list(batch.items())
    return [(f"arg{i}", v) for i, v in enumerate(batch)]


def forward_call(model, batch) -> tuple[tuple, dict]:
    """(args, kwargs) for model(...): a dict as keywords, a tuple as positional args, a Tensor
    bound to forward's first parameter whatever its name (`forward(self, tokens)`,
    `forward(self, input_ids)`) - by keyword only where that parameter is keyword-only."""
    import inspect

    from tpdiag.errors import BadInput

    if isinstance(batch, dict):
        return (), batch
    if isinstance(batch, tuple):
        return batch, {}
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):  # no signature to read (a C extension): positional
        return (batch,), {}
    if not params:
        raise BadInput(f"{type(model).__name__}.forward takes no argument: tpdiag has tokens "
                       "to feed it (give Target.inputs to say how)")
    first = params[0]
    if first.kind is inspect.Parameter.KEYWORD_ONLY:
        return (), {first.name: batch}
    if first.kind is inspect.Parameter.VAR_KEYWORD:
        return (), {"input_ids": batch}
    return (batch,), {}
