"""gather_records at TP=2 (a real gloo world): a record whose shard hash every rank shares is a
replica, stored once from rank 0 with no byte moved; everything else is gathered byte for byte."""
import os

import torch
import torch.distributed as dist

from conftest import gloo_world


def _records(rank: int, forge: bool):
    from tpdiag.records.hashing import tensor_hash

    g = torch.Generator().manual_seed(0)
    same = torch.randn(64, 16, generator=g)
    shard = torch.randn(32, 16, generator=g) + rank
    unhashed = torch.randn(8, 8, generator=g)
    noisy = same[:8].clone()
    noisy[3, 3] += rank  # a replica that is not one: rank 1 holds other bits

    def meta(i, key, t, h=True):
        m = {"key": key, "idx": i, "dtype": str(t.dtype).replace("torch.", ""), "local_shape": list(t.shape)}
        if h:
            m["hash"] = tensor_hash(t)
        return m

    recs = [(meta(0, "replica", same), same), (meta(1, "shard", shard), shard),
            (meta(2, "unhashed", unhashed, h=False), unhashed), (meta(3, "noisy", noisy), noisy)]
    if forge:  # every rank claims rank 0's hash for the noisy record: decided by hash alone
        recs[3][0]["hash"] = tensor_hash(same[:8])
    return recs


def _worker(rank, world, port, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from tpdiag.runner.gather import gather_records

    moved = []
    real_gather = dist.gather

    def counting(t, *a, **k):
        if t.dtype == torch.uint8:  # the records' bytes (not the stored hashes' lanes: int64)
            moved.append(t.numel())
        return real_gather(t, *a, **k)

    dist.gather = counting
    try:
        out = {}
        for forge in (False, True):
            moved.clear()
            got = gather_records(_records(rank, forge), torch.device("cpu"))
            if rank == 0:
                out[forge] = {"moved": sum(moved), "calls": list(moved),
                              "stored": {m["key"]: (m["stored"], m["ranks_equal"], m["stored_hash"], t.tolist())
                                         for m, t in got}}
    finally:
        dist.gather = real_gather
    if rank == 0:
        q.put(out)
    dist.barrier()
    dist.destroy_process_group()


def test_replicas_by_hash_move_no_bytes():
    from tpdiag.records.hashing import tensor_hash

    res = gloo_world(_worker, 2, timeout=120)
    for run in res.values():  # plain lists through the queue (a tensor's shared memory dies with its rank)
        run["stored"] = {k: (*v[:3], torch.tensor(v[3])) for k, v in run["stored"].items()}
    r0, r1 = _records(0, False), _records(1, False)
    honest, forged = res[False], res[True]
    st = honest["stored"]
    # a replica: rank 0's tensor, stored once; its stored hash is the hash of what is stored
    assert st["replica"][:2] == ("single", True) and torch.equal(st["replica"][3], r0[0][1])
    # a shard and a rank-inconsistent replica: both ranks' bits, stacked
    for key, i in (("shard", 1), ("noisy", 3)):
        assert st[key][:2] == ("stacked", False), key
        assert torch.equal(st[key][3], torch.stack([r0[i][1], r1[i][1]])), key
    # no hash: decided by the bytes, which are equal
    assert st["unhashed"][:2] == ("single", True) and torch.equal(st["unhashed"][3], r0[2][1])
    for _, _, h, t in st.values():
        assert h == tensor_hash(t)
    # bytes moved (4 bytes an element, each rank's share counted on its own rank 0 view):
    # the shard, the unhashed record and the noisy one - never the replica
    per_rank = 4 * (32 * 16 + 8 * 8 + 8 * 16)
    assert honest["moved"] == per_rank, honest["calls"]
    # the decision is the hashes': a forged equal hash makes the noisy record a replica, and its
    # bytes are not moved (the negative control of the honest run above, where they were)
    assert forged["stored"]["noisy"][:2] == ("single", True)
    assert forged["moved"] == per_rank - 4 * 8 * 16
