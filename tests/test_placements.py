"""Every DTensor placement torch has, gathered by tpdiag's own path (Recorder -> gather_records ->
layout.assemble) in a real 2-rank gloo world, against torch's DTensor.full_tensor(): bitwise."""
import os

import pytest
import torch
import torch.distributed as dist

from conftest import gloo_world

# (name, placement factory, whole shape)
CASES = [
    ("shard0", lambda pt: pt.Shard(0), (6, 5)),
    ("shard1", lambda pt: pt.Shard(1), (3, 8)),
    ("shard-neg", lambda pt: pt.Shard(-1), (2, 3, 4)),
    ("replicate", lambda pt: pt.Replicate(), (4, 3)),
    ("strided1x2", lambda pt: pt._StridedShard(1, split_factor=2), (4, 8, 3)),
    ("strided0x3", lambda pt: pt._StridedShard(0, split_factor=3), (12, 5)),
    ("strided1x3", lambda pt: pt._StridedShard(1, split_factor=3), (2, 18, 2)),
    ("strided-sf1", lambda pt: pt._StridedShard(0, split_factor=1), (6, 2)),
]
PARTIALS = ["sum", "avg", "max", "min"]


def _worker(rank, world, port, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, distribute_tensor
    from torch.distributed.tensor import placement_types as pt

    from tpdiag.records.layout import assemble, full_shape_guess
    from tpdiag.errors import Inconclusive
    from tpdiag.probes.recorder import Recorder
    from tpdiag.runner.gather import gather_records

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(0)
    rec = Recorder(world=world, rank=rank)
    fulls = {}
    for name, make, shape in CASES:
        whole = torch.randn(shape, generator=g)
        d = distribute_tensor(whole, mesh, [make(pt)])
        rec.add("out", name, "0", d)
        fulls[name] = (whole, d.full_tensor(), d.placements)
    for op in PARTIALS:
        # each rank's own addend: a genuine partial (ranks differ)
        local = torch.randn((5, 3), generator=torch.Generator().manual_seed(10 + rank))
        d = DTensor.from_local(local, mesh, [pt.Partial(op)], run_check=False)
        rec.add("out", f"partial-{op}", "0", d)
        fulls[f"partial-{op}"] = (None, d.full_tensor(), d.placements)
    out = gather_records(rec.records, torch.device("cpu"))
    # hash mode: each shard hashed in place (a _StridedShard piece by piece), composed on rank 0
    hrec = Recorder(world=world, rank=rank, mode="hash")
    for name, make, shape in CASES:
        hrec.add("out", name, "0", distribute_tensor(fulls[name][0], mesh, [make(pt)]))
    hashed = gather_records(hrec.records, torch.device("cpu"), lanes=hrec.lanes, hashbuf=hrec.hashbuf)
    # uneven Shard: torch allows it; tpdiag's gather needs equal shards and says so (typed)
    rec2 = Recorder(world=world, rank=rank)
    rec2.add("out", "uneven", "0", distribute_tensor(torch.randn(5, 2, generator=g), mesh, [pt.Shard(0)]))
    try:
        gather_records(rec2.records, torch.device("cpu"))
        uneven = "gathered"
    except Inconclusive as e:
        uneven = f"{type(e).__name__}: {e}"
    if rank == 0:
        res = {}
        for meta, stored in out:
            whole, ft, placements = fulls[meta["module"]]
            a = assemble(meta, stored, full_shape_guess(meta))
            res[meta["module"]] = {
                "label": meta["placement"], "torch_is_whole": whole is None or torch.equal(ft, whole),
                "bitwise": a.full is not None and a.full.shape == ft.shape
                and torch.equal(a.full.view(torch.int32), ft.view(torch.int32)),
                # a negative control: rank 0's piece alone (what 'replicate' would have taken)
                "rank0_only_equal": torch.equal(stored[0] if meta["stored"] == "stacked" else stored, ft)}
        from tpdiag.kernels.hash_buffer import HashBuffer
        from tpdiag.records.hashing import hash_of_lanes

        for meta, _ in hashed:
            whole = fulls[meta["module"]][0]
            buf = HashBuffer(torch.device("cpu"))
            row = buf.take([buf.add(whole)])[0][0].tolist()
            want = hash_of_lanes(row[0] & 0xFFFFFFFF, row[1] & 0xFFFFFFFF, meta["dtype"], list(whole.shape))
            res[meta["module"]]["hash_equal"] = meta["full_hash"] == want
            res[meta["module"]]["hash_layout"] = meta["hash_layout"]
        q.put({"res": res, "uneven": uneven})
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def gathered():
    return gloo_world(_worker, 2, timeout=120)


def test_every_placement_gathers_bitwise_to_full_tensor(gathered):
    res = gathered["res"]
    assert set(res) == {c[0] for c in CASES} | {f"partial-{op}" for op in PARTIALS}
    for name, r in res.items():
        assert r["torch_is_whole"], (name, r)
        assert r["bitwise"], (name, r)
    assert res["strided1x2"]["label"] == "strided:1:2" and res["strided0x3"]["label"] == "strided:0:3"
    assert res["shard-neg"]["label"] == "shard:2" and res["strided-sf1"]["label"] == "shard:0"
    assert res["partial-sum"]["label"] == "partial" and res["partial-max"]["label"] == "partial:max"
    for name, _, _ in CASES:  # hash mode: the composed whole-tensor hash is the unsharded one
        assert res[name]["hash_equal"], (name, res[name])
    assert res["strided1x3"]["hash_layout"] == "strided:1:3"
    # negative control: the strided shards are not rank 0's piece (the old 'replicate' reading)
    for name in ("strided1x2", "strided0x3", "strided1x3"):
        assert not res[name]["rank0_only_equal"], name


def test_uneven_shard_is_a_typed_error(gathered):
    assert gathered["uneven"].startswith("Inconclusive: ranks recorded different event streams")


def test_unknown_placement_is_a_typed_error():
    from torch.distributed.tensor import placement_types as pt

    from tpdiag.errors import Inconclusive, UnsupportedLayout
    from tpdiag.base.dtensors import label_of_placement

    class OddShard(pt.Shard):  # a Shard subclass whose layout tpdiag cannot know
        pass

    with pytest.raises(UnsupportedLayout) as e:
        label_of_placement(OddShard(0), 2)
    assert isinstance(e.value, Inconclusive) and "\n" not in str(e.value)
    assert "OddShard" in str(e.value)
    with pytest.raises(UnsupportedLayout):
        label_of_placement(object(), 2)
