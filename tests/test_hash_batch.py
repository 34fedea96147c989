"""Hash mode's queued records (kernels/hash_buffer.py): many records hashed in one launch give
exactly the rows one launch per record gives; a tensor changed in place before its queued hash
ran is marked stale, never hashed as its new value; a phase change flushes the queue first, and so
does TPDIAG_HASH_CAP_MB of queued bytes; the same unchanged tensor recorded twice is hashed once. Through the Triton interpreter (a
subprocess: the flag must be set before Triton is imported)."""
import os
import subprocess
import sys

import pytest

from conftest import ROOT, free_port

CODE = r"""
import torch
from tpdiag.kernels import record_hash as rh
from tpdiag.kernels import record_hash_batch as rb
from tpdiag.kernels import hash_buffer as hb
from tpdiag.probes.recorder import Recorder

rh._triton()
# the CPU tensors of the interpreter stand in for CUDA ones
rh.triton_ok = lambda t: type(t) is torch.Tensor and t.dtype in rh._TRITON_T and t.numel() > 0
torch.manual_seed(0)

def want(t, dim=None, full=None, off=0):
    ints, _ = rh.lanes_torch(t, *rh.slab(t.shape, dim, full, off))
    ints[:2] &= rh.M32
    return ints

# 1. a mix of launch keys (widths, tiles, masks, alignment), queued 5 at a time
cases = []
for shape in ((3, 10, 1100), (4, 8, 1024), (4, 8, 64), (7,)):
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        full = torch.randn(*shape).to(dt)
        full.view(-1)[0] = float("nan")
        for dim in [None] + list(range(len(shape))):
            if dim is None:
                cases.append((full, None, None, 0))
                continue
            off = 0
            for p in full.chunk(2, dim=dim):
                cases.append((p.contiguous(), dim, full.shape[dim], off))
                off += p.shape[dim]
# one record at an odd address (not 16-byte aligned: the ALIGNED=False kernel)
base = torch.randn(1 + 4096)
cases.append((base[1:], None, None, 0))
buf = hb.HashBuffer(torch.device("cpu"), batch=5)
slots = [buf.add(t, d, f, o) for t, d, f, o in cases]
assert buf.queued < 5
ints, floats = buf.take(slots)
keys = set()
for (t, d, f, o), got in zip(cases, ints):
    got = got.clone(); got[:2] &= rh.M32
    assert torch.equal(got, want(t, d, f, o)), (t.dtype, t.shape, d)
    keys.add(rb.batch_entry(t, d, f, o, 0)[0])
assert len(keys) >= 6 and {k[-1] for k in keys} == {True, False}, keys
assert not buf.stale

# 1b. TPDIAG_HASH_CAP_MB: a launch once the queued tensors reach the cap
import os
os.environ["TPDIAG_HASH_CAP_MB"] = "1"
buf = hb.HashBuffer(torch.device("cpu"), batch=64)
ts = [torch.randn(256, 320) for _ in range(5)]  # 320 KiB each: the 4th reaches 1 MiB
sl = [buf.add(t) for t in ts]
assert buf.queued == 1, buf.queued
ints, _ = buf.take(sl)
for t, got in zip(ts, ints):
    got = got.clone(); got[:2] &= rh.M32
    assert torch.equal(got, want(t))
del os.environ["TPDIAG_HASH_CAP_MB"]

# 2. changed in place before the queued hash ran: stale, not the new value's hash
buf = hb.HashBuffer(torch.device("cpu"), batch=64)
a = torch.randn(64, 32)
b = torch.randn(32, 64).t()            # not contiguous: queued as a copy, safe
sa, sb = buf.add(a), buf.add(b)
wa, wb = want(a), want(b.contiguous())
a.mul_(2); b.mul_(2)
ints, _ = buf.take([sa, sb])
assert int(ints[0][2]) == hb.STALE and buf.stale == [sa]
got = ints[1].clone(); got[:2] &= rh.M32
assert torch.equal(got, wb)

# 3. a phase change flushes: a grad clipped in place after the backward phase keeps its hash
for phase_change in (True, False):
    rec = Recorder(mode="hash")
    rec.phase = "backward"
    g = torch.randn(128, 16)
    w0 = want(g)
    rec.add("param_grad", "layers.0.w", "weight", g)
    if phase_change:
        rec.phase = "optimizer"
    g.mul_(0.5)  # what clipping does
    ints, _ = rec.hashbuf.take(rec.lanes)
    got = ints[0].clone(); got[:2] &= rh.M32
    if phase_change:
        assert torch.equal(got, w0)
    else:
        assert int(ints[0][2]) == hb.STALE  # the negative control: caught, not misread

# 4. the same unchanged tensor under two keys: one row; changed in place: a new row
rec = Recorder(mode="hash")
rec.phase = "forward"
x = torch.randn(16, 32)
rec.add("out", "layers.0.attention_norm", "0", x)
rec.add("in", "layers.0.attention.wq", "0", x)
rec.add("in", "layers.0.attention.wk", "0", x.clone())
x.add_(1)
rec.add("in", "layers.0.attention.wv", "0", x)
assert rec.lanes[0] == rec.lanes[1] and len(set(rec.lanes)) == 3, rec.lanes
ints, _ = rec.hashbuf.take(rec.lanes)
assert int(ints[0][2]) == hb.STALE  # queued before x.add_: stale, and so is its shared row
got = ints[3].clone(); got[:2] &= rh.M32
assert torch.equal(got, want(x))

# 4b. a plan cached before the chunk length changed (the benchmarks' hash-itersN modes do):
# the key carries the plan's chunk length, so the record is still hashed whole
t = torch.randn(64, 1024).to(torch.bfloat16)  # 64Ki elements: 4 chunks of 16 tiles, 16 of 4
buf = hb.HashBuffer(torch.device("cpu"), batch=64)
ints, _ = buf.take([buf.add(t)])  # planned at 16 tiles a chunk
iters0 = rh.ITERS_2BYTE
rh.ITERS_2BYTE = 4
try:
    u = torch.randn(64, 1024).to(torch.bfloat16)
    s = buf.add(u)  # the cached plan (16 tiles a chunk)
    ints, _ = buf.take([s])
    got = ints[0].clone(); got[:2] &= rh.M32
    assert torch.equal(got, want(u)), (got, want(u))
    # negative control: that plan launched with 4-tile chunks hashes a quarter of the record
    key, _w, row = rb.batch_entry(u, None, None, 0, 0)
    assert key[5] == 16, key  # (width, bf16, block, layout, slab16, ITERS, aligned)
    bad = key[:5] + (4,) + key[6:]
    table = torch.tensor([row], dtype=torch.int64)
    oi, of = torch.zeros(1, 4, dtype=torch.int64), torch.zeros(1, 2, dtype=torch.float64)
    rb.batch_launch(bad, table, 1, 4, oi, of)
    oi[0, :2] &= rh.M32
    assert not torch.equal(oi[0], want(u)), "a mismatched chunk length must not hash the record whole"
finally:
    rh.ITERS_2BYTE = iters0
    rb._ENTRY.clear()

# 5. a DTensor changed in place bumps its own version counter, not its local tensor's: watched
# for the queue's stale check and for the one-hash-per-tensor reuse
import os
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"])
dist.init_process_group("gloo", rank=0, world_size=1)
p = distribute_tensor(torch.randn(8, 64), init_device_mesh("cpu", (1,)), [Shard(0)])
rec = Recorder(mode="hash")
rec.phase = "optimizer"
rec.add("param", "tok_embeddings", "weight", p)
p.mul_(2)
rec.add("param", "tok_embeddings", "weight", p)
assert rec.lanes[0] != rec.lanes[1], rec.lanes
ints, _ = rec.hashbuf.take(rec.lanes)
assert int(ints[0][2]) == hb.STALE
got = ints[1].clone(); got[:2] &= rh.M32
assert torch.equal(got, want(p.to_local()))
dist.destroy_process_group()
print("ok")
"""


def test_batched_hash_equals_one_launch_per_record_and_catches_inplace_changes(interpreted):
    assert "PART batch ok" in interpreted["stdout"] and interpreted["rc"] == 0, interpreted["stderr"][-3000:]


def test_direct_launch_passes_every_kernel_parameter():
    """On CUDA a compiled record-hash kernel is launched directly (record_hash._direct), with
    every parameter, constexprs included, positionally - a check Triton's JIT path does not
    make, and that only a GPU would trip (a TypeError on the first cached launch: session 8's
    MIX parameter was missing from the batch launch). Both launch sites' argument tuples must
    name each kernel parameter once, in order."""
    import pytest
    import torch
    pytest.importorskip("triton")
    from tpdiag.kernels import record_hash as rh
    from tpdiag.kernels import record_hash_batch as rb
    from tpdiag.kernels import record_hash_triton as rt

    batch = rt._hash_batch_kernel.arg_names
    assert tuple(batch[4:]) == rb.BATCH_CONSTEXPRS
    t = torch.zeros(4, 300, dtype=torch.bfloat16)
    key, _words, _row = rb.batch_entry(t, 1, 600, 300, 0)
    table = torch.zeros(1, rb.TABLE_COLS, dtype=torch.int64)
    args = rb.batch_args(key, table, 4, torch.zeros(1, 4, dtype=torch.int64), torch.zeros(1, 2, dtype=torch.float64))
    assert len(args) == len(batch), (len(args), batch)
    named = dict(zip(batch, args))
    width, is_bf16, blk, row_iters, slab16, iters, aligned = key
    assert iters == rh.iters_for(16) and blk == rh.BLOCK
    assert {k: named[k] for k in rb.BATCH_CONSTEXPRS} == {
        "WIDTH": 16, "IS_BF16": True, "BLK": blk, "ITERS": iters, "ROW_ITERS": row_iters,
        "ALIGNED": aligned, "SLAB16": slab16, "PAIRS": rh.PAIRS[0], "MIX": rh.HASH_VERSION}
    assert named["NPROG"] == 4 and named["table_ptr"] is table

    seen = []
    launch = rh._launch
    try:
        rh._launch = lambda args, nprog, warps, device: seen.append(args)
        rh.triton_lanes(t, *rh.slab(t.shape, 1, 600, 300))
    finally:
        rh._launch = launch
    assert len(seen) == 1 and len(seen[0]) == len(rt._hash_kernel.arg_names)


PARTITION = r"""
import torch
from tpdiag.kernels import record_hash as rh
from tpdiag.kernels import record_hash_batch as rb
from tpdiag.kernels import hash_buffer as hb
from tpdiag.probes.recorder import Recorder
from tpdiag.runner.worker import _probe_selfcheck

rh._triton()
rh.triton_ok = lambda t: type(t) is torch.Tensor and t.dtype in rh._TRITON_T and t.numel() > 0
torch.manual_seed(0)
# a 16-bit record spans more chunks than a launch has programs: a launch of it alone gets more
# programs per SM (record_hash.FILL_2BYTE) than one it shares, so the programs' partial lane
# sums - each added into the row unreduced - are grouped differently. x: 17 chunks, one more
# than the 16 programs of a 4-record launch (the 20 of [40, 8192] gave 20 programs against 16);
# the others set the launch's record count only: one whole chunk each, the same launch key as x
x = torch.randn(34, 8192).to(torch.bfloat16)
others = [torch.randn(2, 8192).to(torch.bfloat16) for _ in range(3)]

def rec_of(tensors):
    r = Recorder(mode="hash")
    r.hashbuf = hb.HashBuffer(torch.device("cpu"), batch=64)
    for i, t in enumerate(tensors):
        r.add("logits" if t is x else "param", "model", "x" if t is x else str(i), t, phase="loss")
    return r

alone, shared = rec_of([x]), rec_of(others + [x])
a, s = alone.hashbuf.take([alone.lanes[0]])[0][0], shared.hashbuf.take([shared.lanes[-1]])[0][0]
# the premise: the two launches split x differently, and its raw rows differ (high bits)
chunks = rh.plan(1, x.numel(), rh.BLOCK, rh.iters_for(16))[4]
dev = torch.device("cpu")
assert rb.batch_nprog(chunks, dev, 16, 1) != rb.batch_nprog(chunks, dev, 16, 4)
raw_a, raw_s = alone.hashbuf.ints[0][alone.lanes[0]], shared.hashbuf.ints[0][shared.lanes[-1]]
assert not torch.equal(raw_a[:2], raw_s[:2]) and torch.equal(raw_a[:2] & rh.M32, raw_s[:2] & rh.M32)
assert a[2:].tolist() == s[2:].tolist()
# rows read back are the record format's lanes (mod 2**32), whatever the launch
assert torch.equal(a, s), (a.tolist(), s.tolist())
assert int(a[0]) < 2**32 and int(a[1]) < 2**32
# the self-check (probes on vs off) compares such rows: the same tensor must pass it (its key
# s0/loss/model/logits#0/x in both; the others are checked only where the unprobed run has them)
got = _probe_selfcheck(rec_of([x]), rec_of(others + [x]), torch.device("cpu"))
assert got["equal"] and got["checked"] == 1, got
print("ok")
"""


# Both scripts in ONE interpreter (its torch and Triton imports once), each in a namespace of its
# own: PARTITION first (it changes nothing global), then CODE (which restores what it sets: the
# queue cap variable, record_hash.ITERS_2BYTE; its one-rank process group destroyed at its end).
# Each part's outcome is its own test's.
DRIVER = r"""
import sys, traceback
for name, src in zip(("partition", "batch"), sys.argv[1:]):
    try:
        exec(compile(src, name, "exec"), {"__name__": "__main__"})
        print(f"PART {name} ok", flush=True)
    except BaseException:
        print(f"PART {name} failed", flush=True)
        traceback.print_exc()
"""


@pytest.fixture(scope="module")
def interpreted():
    import triton

    if tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 9):
        # Triton 3.6's interpreter (the GPU machines' image) hands a loaded scalar to the batched
        # kernel's loop bounds as a 1-element array and fails in int(); the compiled kernel is the
        # one those machines run, checked bit for bit by `python -m benchmarks record-hash`
        pytest.skip(f"Triton {triton.__version__}'s interpreter cannot run the batched hash kernel (3.9 can)")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT, PORT=str(free_port()))
    p = subprocess.run([sys.executable, "-c", DRIVER, PARTITION, CODE], capture_output=True, text=True, env=env,
                       timeout=900)
    return {"stdout": p.stdout, "stderr": p.stderr, "rc": p.returncode}


def test_hash_rows_do_not_depend_on_the_launch_partition(interpreted):
    """The same tensor's row, hashed in a launch of its own and in one it shares, is the same
    (lanes mod 2**32): on a GPU the two launches split the tensor over different numbers of
    programs. The worker's self-check compared the rows as read back, and on CUDA bf16 compares
    with large records failed it at the logits since the launch fill (a record alone gets more
    programs): a false "the probes changed its numerics" (session 17, H200: llama-1b, the 4B
    config)."""
    assert "PART partition ok" in interpreted["stdout"] and interpreted["rc"] == 0, interpreted["stderr"][-3000:]


def test_narrow_tiles_plan_and_register_cap(monkeypatch):
    """A last-dim shard exactly as wide as its tile reads dense tiles (ROW_ITERS 2: constant
    offsets); a wider or ragged one strided tiles (1); a whole tensor tiles along it (0). The
    register cap goes to 32-bit strided tiles and 16-bit dense ones read as word pairs only - what
    an H200 measured faster (record_hash.narrow_regs); TPDIAG_HASH_NARROW_REGS sets one cap for
    every narrow tile, 255 none."""
    import torch

    from tpdiag.kernels import record_hash as rh
    from tpdiag.kernels import record_hash_batch as rb

    it16 = rh.iters_for(16)
    assert rh.plan(1, 1 << 22, rh.BLOCK, it16)[2] == 0
    assert rh.plan(4096, 512, rh.BLOCK, it16)[2] == 2
    assert rh.plan(4096, 2048, rh.BLOCK, it16)[2] == 1
    assert rh.plan(4096, 500, rh.BLOCK, it16)[2] == 1  # ragged: strided, one slab a tile
    assert rh.plan(1, 512, rh.BLOCK, it16)[2] == 1  # one short slab (a small whole tensor): not dense
    monkeypatch.setattr(rh, "_NARROW_REGS", [])
    monkeypatch.delenv("TPDIAG_HASH_NARROW_REGS", raising=False)
    assert [rh.narrow_regs(ri, w, p) for ri, w, p in ((0, 16, True), (1, 16, True), (2, 16, True), (2, 16, False),
                                                      (0, 32, False), (1, 32, False), (2, 32, False))] \
        == [None, None, 96, None, None, 96, None]
    # what a batch launch asks for: its key and the words the kernel will read
    seen = []
    monkeypatch.setattr(rh, "_direct", lambda key, *a: seen.append(key[-1]))
    ints, floats = torch.zeros(1, 4, dtype=torch.int64), torch.zeros(1, 2, dtype=torch.float64)
    table = torch.zeros(1, rb.TABLE_COLS, dtype=torch.int64)
    for t in (torch.zeros(64, 512, dtype=torch.bfloat16), torch.zeros(64, 512, dtype=torch.float16),
              torch.zeros(1 + 64 * 512, dtype=torch.bfloat16)[1:].view(64, 512),  # 2-byte aligned: no words
              torch.zeros(64, 2048, dtype=torch.bfloat16), torch.zeros(64, 2048), torch.zeros(64, 512)):
        key = rb.batch_entry(t, 1, 4 * t.shape[1], t.shape[1], 0)[0]
        rb.batch_launch(key, table, 1, 4, ints, floats)
    assert seen == [96 if rh.PAIRS[0] else None, None, None, None, 96, None], seen
    monkeypatch.setattr(rh, "_NARROW_REGS", [])
    monkeypatch.setenv("TPDIAG_HASH_NARROW_REGS", "255")
    assert rh.narrow_regs(2, 16, True) is None and rh.narrow_regs(1, 32, False) is None
    monkeypatch.setattr(rh, "_NARROW_REGS", [])
    monkeypatch.setenv("TPDIAG_HASH_NARROW_REGS", "80")
    assert [rh.narrow_regs(ri, w, p) for ri, w, p in ((0, 32, False), (1, 16, True), (2, 32, False))] == [None, 80, 80]
