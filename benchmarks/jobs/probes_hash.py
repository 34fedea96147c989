"""The record hash's device side: throughput against the memory bandwidth, launch shapes, host
time per hashed record (CUDA). `python -m benchmarks probes hash | hash-sweep | launch`; see
probes.py for the job's flags.

`hash`: kernels/record_hash.shard_lanes on 1 GiB tensors (whole, and as a last-dim shard),
against torch.sum (a read-only pass: the achievable read bandwidth) and the spec bandwidth; each
code path (PAIRS) with the first lane mix and the shipped one (MIX 1 / 2) side by side.
"""
from __future__ import annotations

import os
import platform
import statistics
import time

from benchmarks.errors import require_cuda
from benchmarks.jobs.probes_util import device_name as _device_name, seconds as _seconds


def _waves(args) -> list:
    """--waves '4,16' -> [4, 16]; absent: [None] (the shipped programs per SM)."""
    w = getattr(args, "waves", None)
    if not w:
        return [None]
    parts = [p.strip() for p in w.split(",")]
    if not all(p.isdigit() and 1 <= int(p) <= 64 for p in parts):
        raise SystemExit(f"--waves {w!r}: expected integers from 1 to 64, comma-separated")
    return [int(p) for p in parts]


def hash_throughput(args) -> dict:
    waves = _waves(args)  # a bad --waves is one line, before any GiB is allocated
    require_cuda("probes hash")
    import torch

    from tpdiag.kernels import record_hash as rh
    from tpdiag.kernels.record_hash import shard_lanes

    dev = torch.device("cuda")
    peak = args.peak_gbs
    rows = []

    bench = lambda fn: _seconds(fn, rep=200)  # noqa: E731

    rounds = max(1, getattr(args, "rounds", 1) or 1)
    for dt in (torch.bfloat16, torch.float32):
        n = (1 << 30) // torch.tensor([], dtype=dt).element_size()
        x = torch.randn(n // 8192, 8192, device=dev, dtype=dt)
        nbytes = x.numel() * x.element_size()
        y = torch.empty_like(x)
        # (what, fn, lanes equal to the torch path's or None); every row timed `rounds` times,
        # the rows interleaved round by round: one timing of a 1 GiB pass moves by +-5% within a
        # run (session 14), so a row is a median over rounds, with its spread
        what_fn = [("torch.sum (read once)", lambda: x.sum(dtype=torch.float32), None),
                   # a device-to-device copy: the memory system's ceiling (bytes read + written)
                   ("copy", lambda: y.copy_(x), None),
                   ("record hash, whole", lambda: shard_lanes(x), None),
                   # a last-dim shard (rank 1 of 4): one slab per row, the offset applied per slab
                   ("record hash, last-dim shard", lambda: shard_lanes(x, 1, 4 * 8192, 8192), None),
                   *_narrow_rows(x, shard_lanes), *_base_rows(x, shard_lanes)]
        # 16-bit data element-wise and as word pairs (kernels/record_hash.py PAIRS), and the lane
        # mixes (record_hash_ref.py MIXES: 1 the first, 2 shipped) side by side, each one's lanes
        # checked against the torch path's
        # (--waves: the variants also at other programs per SM)
        for pairs, mix, wv in [(p, m, w) for p in ((False, True) if dt != torch.float32 else (False,))
                               for m in rh.MIXES for w in waves]:
            tag = f"pairs={int(pairs)}, mix {mix}" + ("" if wv is None else f", {wv}/SM")
            for label, where in (("whole", (None, None, 0)), ("last-dim shard", (1, 4 * 8192, 8192))):
                sl = rh.slab(x.shape, *where)
                fn = (lambda sl=sl, pairs=pairs, mix=mix, wv=wv:
                      rh.triton_lanes(x, *sl, pairs=pairs, mix=mix, waves=wv))
                got = fn()[0][:2] & rh.M32
                want = rh.lanes_torch(x, *sl, mix=mix)[0][:2] & rh.M32
                what_fn.append((f"record hash, {label}, {tag}", fn, bool(torch.equal(got, want))))
        times: dict = {what: [] for what, _, _ in what_fn}
        for k in range(rounds):
            # each round starts further along the rows (spread over the rounds): identical
            # launches in different rows of one call read up to 8% apart with a fixed order
            # (session 17), a place in the round that interleaving alone does not average out
            at = k * len(what_fn) // rounds
            for what, fn, _ in what_fn[at:] + what_fn[:at]:
                times[what].append(bench(fn))
        t_sum = statistics.median(times["torch.sum (read once)"])
        copy_gbs = 2 * nbytes / statistics.median(times["copy"]) / 1e9
        for what, _, same in what_fn:
            if what == "copy":
                continue
            ts = times[what]
            t = statistics.median(ts)
            rows.append({"dtype": str(dt).replace("torch.", ""), "what": what, "ms": 1e3 * t,
                         "gbs": nbytes / t / 1e9, "gbs_range": [nbytes / max(ts) / 1e9, nbytes / min(ts) / 1e9],
                         "rounds": len(ts), "of_peak": nbytes / t / 1e9 / peak,
                         "of_sum": t_sum / t, "copy_gbs": copy_gbs, "of_copy": nbytes / t / 1e9 / copy_gbs,
                         "lanes_equal_torch": same})
        del x, y
        torch.cuda.empty_cache()
    lines = [f"hash throughput: {_device_name()}, 1 GiB tensors, spec bandwidth {peak:.0f} GB/s; median of "
             f"{rounds} interleaved round(s), GB/s range over them; copy = a device-to-device copy of the same "
             "tensor, bytes read + written",
             "| dtype | what | ms | GB/s (range) | of spec bandwidth | of copy GB/s | of torch.sum's | lanes = torch path |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lo, hi = r["gbs_range"]
        lines.append(f"| {r['dtype']} | {r['what']} | {r['ms']:.3f} | {r['gbs']:.0f} ({lo:.0f}-{hi:.0f}) | "
                     f"{100 * r['of_peak']:.0f}% | {100 * r['of_copy']:.0f}% of {r['copy_gbs']:.0f} | "
                     f"{100 * r['of_sum']:.0f}% | {'' if r['lanes_equal_torch'] is None else r['lanes_equal_torch']} |")
    print("\n".join(lines))
    return {"device": _device_name(), "peak_gbs": peak, "rows": rows}


def _shard(x, shard_lanes, width, ways):
    """(shard_lanes of x's bytes as a last-dim shard `width` wide, rank 1 of `ways` - or whole,
    width None; its lanes by the torch path)."""
    from tpdiag.kernels import record_hash as rh

    v = x if width is None else x.view(-1, width)
    where = (None, None, 0) if width is None else (1, ways * width, width)
    return (lambda: shard_lanes(v, *where)), rh.lanes_torch(v, *rh.slab(v.shape, *where))[0][:2] & rh.M32


def _rows(label: str, variants, want) -> list:
    """`hash` rows (label + suffix, fn, lanes equal the torch path's) of each (suffix, fn)."""
    import torch

    from tpdiag.kernels import record_hash as rh

    return [(label + suffix, f, bool(torch.equal(f()[0][:2] & rh.M32, want))) for suffix, f in variants]


def _narrow_rows(x, shard_lanes) -> list:
    """`hash`'s rows for narrower last-dim shards of x's bytes (a view): 2048 wide is a TP=4 shard
    of an 8192-wide dim, 512 wide a TP=8 shard of 4096, where the kernel's [R x CB] tiles stack
    rows (issue #20 item 2 asks >= 80% of HBM for last-dim shards too), also capped at 96 and
    uncapped. Timed in the same interleaved rounds as the other rows; each one's lanes checked
    against the torch path's."""
    rows = []
    for width, ways in ((2048, 4), (512, 16)):
        fn, want = _shard(x, shard_lanes, width, ways)
        rows += _rows(f"record hash, last-dim shard {width} wide",
                      (("", fn), (", register cap 96", _capped(fn, 96)), (", no register cap", _capped(fn, 255))), want)
    return rows


def _base_rows(x, shard_lanes) -> list:
    """With PROBES_BASE_KERNEL (probes_util.base_kernel): the shipped launches of x's bytes -
    whole, and last-dim shards 8192, 2048 and 512 wide - through another commit's kernels, in the
    same interleaved rounds as this tree's, each one's lanes checked against the torch path's."""
    from benchmarks.jobs.probes_util import base_kernel, base_kernel_path

    path = base_kernel_path()
    if path is None:
        return []

    def based(fn):
        def run():
            with base_kernel(path):
                return fn()
        return run

    rows = []
    for label, width, ways in (("whole", None, None), ("last-dim shard", 8192, 4),
                               ("last-dim shard 2048 wide", 2048, 4), ("last-dim shard 512 wide", 512, 16)):
        fn, want = _shard(x, shard_lanes, width, ways)
        rows += _rows(f"record hash, {label}", ((f", base kernel ({os.path.basename(path)})", based(fn)),), want)
    return rows


def _capped(fn, regs: int):
    """fn with every narrow tile launched at another register cap (record_hash.narrow_regs; 255:
    none; the kernel compiled apart: the cap is in the direct-launch key)."""
    from tpdiag.kernels import record_hash as rh

    def run():
        saved = list(rh._NARROW_REGS)
        rh._NARROW_REGS[:] = [regs]
        try:
            return fn()
        finally:
            rh._NARROW_REGS[:] = saved

    return run


# launch shapes tried by `hash --sweep` (block, iters, waves, warps); shipped: (1024, 8, 4, 4) for
# 32-bit data; for 16-bit (1024, 16, 4, 4) a record launched with others, (1024, 16, 16, 4) a
# record alone (kernels/record_hash.py ITERS_2BYTE, waves_for, FILL_2BYTE)
HASH_SWEEP = [(1024, 8, 4, 4), (1024, 16, 16, 4), (1024, 16, 8, 4), (1024, 16, 4, 4), (1024, 4, 4, 4),
              (2048, 4, 4, 8)]
# (session 11, H200, bf16: block 2048 or 4096 with fewer iters, Triton's software pipeline of the
# chunk loop (cp.async, 2-4 stages) and a register cap (maxnreg 48-80: spills) were all slower
# than more programs per SM - docs/benchmarks.md)
# (an H200 sweep before the narrow tiles stacked their ITERS over rows also tried (1024, 4, 8, 4),
# (2048, 2, 8, 8), (4096, 2, 4, 8), (2048, 4, 8, 4), (512, 8, 8, 4): none better on whole tensors)


def _shapes(args) -> list[tuple[int, int, int, int]]:
    if not getattr(args, "shapes", None):
        return HASH_SWEEP
    out = []
    for part in args.shapes.split(";"):
        words = part.strip().split(",")
        if len(words) != 4 or not all(w.strip().isdigit() and int(w) > 0 for w in words):
            raise SystemExit(f"--shapes {args.shapes!r}: expected BLOCK,ITERS,WAVES,WARPS;... (integers)")
        out.append(tuple(int(w) for w in words))
    return out


def hash_sweep(args) -> dict:
    """Launch shapes of the record-hash kernel side by side on 1 GiB tensors: whole, and
    last-dim shards 2048 and 512 wide (one slab per row: the narrow [R, CB] tiles)."""
    require_cuda("probes hash-sweep")
    shapes = _shapes(args)  # a bad --shapes is one line, before any GiB is allocated
    import torch

    from tpdiag.kernels import record_hash as rh

    rh._triton()
    dev = torch.device("cuda")
    peak = args.peak_gbs
    rows = []

    bench = lambda fn: _seconds(fn, rep=100)  # noqa: E731

    for dt in (torch.bfloat16, torch.float32):
        n = (1 << 30) // torch.tensor([], dtype=dt).element_size()
        for label, cols, ways in (("whole", 8192, None), ("shard 2048 wide", 2048, 4), ("shard 512 wide", 512, 16)):
            x = torch.randn(n // cols, cols, device=dev, dtype=dt)
            args_ = rh.slab(x.shape, None if ways is None else 1, None if ways is None else cols * ways,
                            0 if ways is None else cols)
            nbytes = x.numel() * x.element_size()
            t_sum = bench(lambda: x.sum(dtype=torch.float32))
            ref = None
            for shape in shapes:
                b, it, wv, wp = shape
                fn = lambda: rh.triton_lanes(x, *args_, block=b, iters=it, waves=wv, warps=wp)  # noqa: E731
                lanes = fn()[0][:2] & rh.M32
                ref = lanes if ref is None else ref
                t = bench(fn)
                rows.append({"dtype": str(dt).replace("torch.", ""), "tensor": label, "shape": shape,
                             "gbs": nbytes / t / 1e9, "of_peak": nbytes / t / 1e9 / peak, "of_sum": t_sum / t,
                             "same_lanes": bool(torch.equal(lanes, ref))})
            del x
            torch.cuda.empty_cache()
    lines = [f"hash launch-shape sweep: {_device_name()}, 1 GiB tensors, spec bandwidth {peak:.0f} GB/s",
             "| dtype | tensor | block, iters, waves/SM, warps | GB/s | of spec | of torch.sum's | lanes = first shape's |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['dtype']} | {r['tensor']} | {r['shape']} | {r['gbs']:.0f} | {100 * r['of_peak']:.0f}% | "
                     f"{100 * r['of_sum']:.0f}% | {r['same_lanes']} |")
    print("\n".join(lines))
    return {"device": _device_name(), "peak_gbs": peak, "rows": rows}


def launch_cost(args) -> dict:
    """Host time per hashed record (no sync inside the loop; the device work is tiny), by layer:
    the raw kernel launch, triton_lanes, shard_lanes, and Recorder.add in hash mode."""
    require_cuda("probes launch")
    import torch

    from tpdiag.kernels import record_hash as rh
    from tpdiag.kernels.hash_buffer import HashBuffer
    from tpdiag.probes.recorder import Recorder

    rh._triton()
    dev = torch.device("cuda")
    x = torch.randn(16, 2048, device=dev, dtype=torch.bfloat16)
    n = 2000

    def per_call(fn):
        # past the first queued launch: its kernel compiles once (in the timed loop it read as
        # ~870 us a record)
        for _ in range(200):
            fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        host = (time.perf_counter() - t) / n
        torch.cuda.synchronize()
        return 1e6 * host

    a, L, b, F, o = rh.slab(x.shape, None, None, 0)
    words = x.view(torch.int16)
    ints = torch.zeros(64, 4, dtype=torch.int64, device=dev)
    floats = torch.zeros(64, 2, dtype=torch.float64, device=dev)
    _, _, row_iters, n_row, n_col, _ = rh.plan(a, L * b)
    nprog = min(n_row * n_col, rh.WAVES * rh._sm_count(dev))
    raw = lambda: rh._triton()._hash_kernel[(nprog,)](words, ints, floats, 0, a, L * b, F * b, o * b, n_col, n_row * n_col,  # noqa: E731
                                             nprog, WIDTH=16, IS_BF16=True, BLK=rh.BLOCK, ITERS=rh.ITERS,
                                             ROW_ITERS=row_iters, num_warps=rh.WARPS)
    res = {"raw kernel launch (Triton JIT dispatch)": per_call(raw)}
    for fast in (False, True):
        rh._FAST[0] = fast
        how = "direct launch" if fast else "JIT dispatch"
        res[f"triton_lanes ({how})"] = per_call(lambda: rh.triton_lanes(x, a, L, b, F, o, (ints, floats, 0)))
        res[f"shard_lanes ({how})"] = per_call(lambda: rh.shard_lanes(x, out=(ints, floats, 0)))
    for batch, how in ((1, "a launch per record"), (64, "queued, 64 per launch")):
        buf = HashBuffer(dev, batch=batch)
        res[f"HashBuffer.add ({how})"] = per_call(lambda: buf.add(x))
        os.environ["TPDIAG_HASH_BATCH"] = str(batch)
        rec = Recorder(mode="hash")
        # a fresh view per call: another tensor object, hashed (the same object again is not)
        res[f"Recorder.add, hash mode ({how})"] = per_call(
            lambda: rec.add("out", "layers.0.mlp", "0", x.view(16, 2048)))
    res["Recorder.add, the same tensor again"] = per_call(lambda: rec.add("in", "layers.0.mlp.w2", "0", x))
    os.environ.pop("TPDIAG_HASH_BATCH")
    rh._FAST[0] = True
    lines = [f"host time per hashed record: {_device_name()}, CPU {platform.processor() or platform.machine()}, "
             f"bf16 [16, 2048], {n} calls", "| layer | us per call |", "|---|---|"]
    lines += [f"| {k} | {v:.1f} |" for k, v in res.items()]
    print("\n".join(lines))
    return res
