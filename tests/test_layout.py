import pytest
import torch

from tpdiag.records.layout import assemble
from tpdiag.errors import NotComparable


def meta(shape, world, stored, placement=None):
    return {"key": "k", "local_shape": shape, "world": world, "stored": stored, "placement": placement}


def test_dtensor_shard_placement_concatenates():
    full = torch.arange(24.0).reshape(2, 12)
    shards = torch.stack(list(full.chunk(4, dim=1)))
    a = assemble(meta([2, 3], 4, "stacked", "shard:1"), shards, None)
    assert torch.equal(a.full, full) and a.layout == "shard:1"


def test_unmarked_shard_inferred_from_reference_shape():
    full = torch.arange(32.0).reshape(4, 8)
    shards = torch.stack(list(full.chunk(2, dim=0)))
    a = assemble(meta([2, 8], 2, "stacked"), shards, [4, 8])
    assert torch.equal(a.full, full) and a.layout == "shard:0"


def test_replica_that_differs_across_ranks_is_flagged():
    x = torch.ones(3)
    y = x.clone()
    y[1] = 2
    a = assemble(meta([3], 2, "stacked"), torch.stack([x, y]), [3])
    assert a.rank_consistent is False and torch.equal(a.full, x)


def test_identical_replica_stored_once():
    a = assemble(meta([3], 4, "single"), torch.ones(3), [3])
    assert a.rank_consistent is True


def test_ungatherable_shape_is_refused():
    with pytest.raises(NotComparable):
        assemble(meta([3, 5], 2, "stacked"), torch.zeros(2, 3, 5), [4, 4])
