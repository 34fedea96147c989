"""On a CUDA GPU: the record-hash Triton kernel against the torch path, bit for bit, and the
shards' lanes adding up to the whole tensor's (fp32 / bf16 / fp16, NaN and Inf included); every
shard also queued in a HashBuffer (many records per launch: _hash_batch_kernel) - same rows, and
records queued from two CUDA streams in turn.

  python -m benchmarks record-hash      # exit 1 on any mismatch; CUDA only (exit 3 without)
"""
import argparse

from benchmarks.errors import require_cuda


def main(argv: list[str]) -> dict:
    argparse.ArgumentParser(prog="benchmarks record-hash", description=__doc__.splitlines()[0]).parse_args(argv)
    require_cuda("record-hash", "the torch path is checked on CPU by tests/test_hashing.py")
    import torch

    from tpdiag.kernels import record_hash as rh
    from tpdiag.kernels.hash_buffer import HashBuffer

    rh._triton()
    torch.manual_seed(0)
    bad = 0
    buf = HashBuffer(torch.device("cuda"), batch=7)
    queued = []  # (slot, torch-path ints)
    # (8, 300, 4100): masked tails; (16, 64, 2048) in 16: 128-wide shards, no masks ([R, CB] tiles);
    # (6, 30, 4101): odd widths and odd slab lengths
    for shape, ways in (((8, 300, 4100), 4), ((16, 64, 2048), 16), ((6, 30, 4101), 4)):
        for dt in (torch.float32, torch.bfloat16, torch.float16):
            full = torch.randn(*shape, device="cuda").to(dt)
            full[0, 0, 0] = float("nan")
            full[1, 2, 3] = float("inf")
            whole, _ = rh.lanes_torch(full, *rh.slab(full.shape, None, None, 0))
            for dim in (None, 0, 1, 2):
                parts = [full] if dim is None else list(full.chunk(ways, dim=dim))
                off, tot = 0, torch.zeros(2, dtype=torch.int64)
                for p in parts:
                    p = p.contiguous()
                    args = rh.slab(p.shape, dim, None if dim is None else full.shape[dim], off)
                    ia, _ = rh.lanes_torch(p, *args)
                    ib, _ = rh.triton_lanes(p, *args)
                    # again: the first launch of a specialisation goes through Triton's JIT,
                    # later ones through the cached direct launch (_launch)
                    ic, _ = rh.triton_lanes(p, *args)
                    # and the other 16-bit code path (word pairs or element by element)
                    others = [rh.triton_lanes(p, *args, pairs=not rh.PAIRS[0])[0]]
                    for i in (ia, ib, ic, *others):
                        i[:2] &= rh.M32
                    bad += sum(int(not torch.equal(ia, i)) for i in (ib, ic, *others))
                    tot += ib[:2].cpu()
                    queued.append((buf.add(p, *args_of(dim, full, off)), ia))
                    off += 0 if dim is None else p.shape[dim]
                ok = bool(((tot & rh.M32) == (whole[:2].cpu() & rh.M32)).all())
                bad += int(not ok)
                print(f"- {shape} {dt} {ways if dim is not None else 1} shards on dim {dim}: kernel == torch per shard and shares add up to the whole: {ok}")
    ints, _ = buf.take([s for s, _ in queued])
    ints[:, :2] &= rh.M32
    qbad = sum(int(not torch.equal(ints[i].cpu(), ia.cpu())) for i, (_, ia) in enumerate(queued))
    print(f"queued (batch of 7 per launch): {len(queued)} records, {qbad} differ from the torch path; stale {len(buf.stale)}")
    bad += qbad + len(buf.stale)
    # queued from two streams in turn (a model on a stream of its own; the launch tables' ring
    # waits once at each switch): the same rows
    side, main_s = torch.cuda.Stream(), torch.cuda.current_stream()
    buf2 = HashBuffer(torch.device("cuda"), batch=3)
    mixed = []
    for k in range(40):
        x = torch.randn(64 + k, 96, device="cuda").to(torch.bfloat16 if k % 2 else torch.float32)
        want_i, _ = rh.lanes_torch(x, *rh.slab(x.shape, None, None, 0))
        want_i[:2] &= rh.M32
        s = side if k % 5 in (1, 2) else main_s
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            mixed.append((buf2.add(x), want_i))
        torch.cuda.current_stream().wait_stream(s)
    ints2, _ = buf2.take([s for s, _ in mixed])
    ints2[:, :2] &= rh.M32
    sbad = sum(int(not torch.equal(ints2[i].cpu(), w.cpu())) for i, (_, w) in enumerate(mixed))
    print(f"queued from two streams in turn (batch of 3): {len(mixed)} records, {sbad} differ; stale {len(buf2.stale)}")
    bad += sbad + len(buf2.stale)
    rbad, nrec, rstale = _through_recorder(torch, rh)
    print(f"through Recorder.add's fast path (HashBuffer.add_whole): {nrec} records, {rbad} differ; stale {rstale}")
    bad += rbad + rstale
    print(f"direct launches cached: {len(rh._COMPILED)} specialisations")
    print(f"mismatches: {bad}")
    return {"records_queued": len(queued), "queued_mismatches": qbad, "stale": len(buf.stale),
            "direct_launch_specialisations": len(rh._COMPILED), "mismatches": bad, "ok": bad == 0}


def _through_recorder(torch, rh):
    """Records made as a TP=1 step makes them (Recorder.add's fast path, HashBuffer.add_whole):
    plain tensors at several alignments, fp32 and bf16, Parameters, transposed views (add's copy),
    some recorded twice (one hash) - against the torch path of each whole tensor."""
    from tpdiag.probes.recorder import Recorder, take_lanes

    rec = Recorder(mode="hash")
    rec.phase = "forward"
    base = torch.randn(1 << 20, device="cuda")
    xs = []
    for k in range(30):
        off = (0, 1, 4, 8)[k % 4]
        t = base[off:off + 1000 * (k + 1)].view(k + 1, 1000)
        if k % 3 == 1:
            t = t.to(torch.bfloat16)
        if k % 5 == 2:
            t = torch.nn.Parameter(t.clone())
        if k % 7 == 3:
            t = t.t()
        xs.append(t)
    for i, t in enumerate(xs + xs[:5]):
        rec.add("out", f"m{i}", "0", t)
    ints, _ = take_lanes(rec.hashbuf, rec.lanes)
    ints[:, :2] &= rh.M32
    bad = 0
    for i, t in enumerate(xs + xs[:5]):
        w = t.detach().contiguous()
        want, _ = rh.lanes_torch(w, *rh.slab(w.shape, None, None, 0))
        want[:2] &= rh.M32
        bad += int(not torch.equal(ints[i].cpu(), want.cpu()))
    return bad, len(rec.lanes), len(rec.hashbuf.stale)


def args_of(dim, full, off):
    return (None, None, 0) if dim is None else (dim, full.shape[dim], off)
