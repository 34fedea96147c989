"""A record pair put in one layout for comparison (diff/engine.py, and the own-input and
own-parameter reads that assemble a side's whole value as the diff does)."""
from __future__ import annotations

import torch

from tpdiag.errors import NotComparable
from tpdiag.records.layout import Assembled, assemble, full_shape_from_pair, full_shape_guess


def _full_hint(meta: dict, other_meta: dict | None) -> list[int] | None:
    g = full_shape_guess(meta)
    if g is None and other_meta is not None:
        g = full_shape_guess(other_meta)
    if g is None and other_meta is not None:
        g = full_shape_from_pair(meta, other_meta)
    return g


def assemble_pair(rm: dict, rt: torch.Tensor, om: dict, ot: torch.Tensor):
    """(reference, other) assembled (records/layout.assemble) to one whole shape: each side's
    guessed from its own metadata, else from the other side's, else from the pair."""
    ra = assemble(rm, rt, _full_hint(rm, om))
    oa = assemble(om, ot, _full_hint(om, rm) if ra.full is None else list(ra.full.shape))
    if ra.full is None and oa.full is not None:
        ra = assemble(rm, rt, list(oa.full.shape))
    return ra, oa


def pair_tensors(ra: Assembled, oa: Assembled):
    """The two sides' tensors to compare: both whole, else their shards stacked where both have as
    many; NotComparable otherwise."""
    if ra.full is not None and oa.full is not None:
        return ra.full, oa.full
    if ra.shards is not None and oa.shards is not None and len(ra.shards) == len(oa.shards):
        return torch.stack(ra.shards), torch.stack(oa.shards)
    raise NotComparable("layouts cannot be matched")
