"""`python -m benchmarks hash-variants [RECORDS] [--base REV]`: how many compiled variants of the
record-hash kernels a compare's records need, and whether the warm-up (runner/warm.py) compiles
them before a world meets them - counted from shapes, on the CPU, no GPU and no compile.

Each distinct Triton compile key is a compile on a fresh machine (~1-2.5 s on an H200 host,
docs/gpu_runs/compile-log-*.txt). A key here is what Triton specialises on for a launch: the
kernel, its constexprs, num_warps, the register cap, the data pointer's 16-byte alignment and,
for `_hash_kernel`, SLAB's specialisation (== 1, % 16) and the integers' int32/int64 types. The
launch paths are record_hash's own (batch_entry / batch_launch, triton_lanes) with the launch
itself replaced by taking its key, so the count is the code's, at this checkout or at REV
(--base: that revision's record_hash.py, record_hash_batch.py and runner/warm.py, loaded from git).

RECORDS: a JSON-lines file of the records the hash kernels take, one line a distinct record -
kernel ("batch": queued, _hash_batch_kernel; "one": hashed alone, _hash_kernel), local shape,
dtype, split dim / full size / offset, misalign (data pointer % 16) and how many records had it.
Default benchmarks/configs/llama1b_tp12_records.jsonl: `tpdiag compare --model llama-1b --layers 2
--tp 1,2 --dtype bfloat16 --seq-len 2048 --batch-size 1 --capture hash` on the CPU with
HashBuffer.add / shard_lanes logged (first pass, TP=1 and both TP=2 ranks; the second pass's
TP=1 and TP=2 worlds until the run was stopped) - the shapes of `compare-1b` at TP=1,2.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
DEFAULT = os.path.join(ROOT, "benchmarks", "configs", "llama1b_tp12_records.jsonl")


def _module_at(rev: str | None, path: str, name: str):
    """The module at `path` in this checkout (rev None) or at git revision `rev`."""
    if rev is None:
        return importlib.import_module(path[:-3].replace("/", "."))
    src = subprocess.run(["git", "-C", ROOT, "show", f"{rev}:{path}"], capture_output=True, text=True, check=True).stdout
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location(name, f.name)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    os.unlink(f.name)
    return mod


def _batch_at(rev: str | None, rh):
    """The batched launch's module (record_hash_batch.py) at `rev`, reading the launch machinery of
    `rh` (that revision's record_hash); rh itself at a revision from before that module."""
    if rev is None:
        return importlib.import_module("tpdiag.kernels.record_hash_batch")
    if subprocess.run(["git", "-C", ROOT, "cat-file", "-e", f"{rev}:tpdiag/kernels/record_hash_batch.py"],
                      capture_output=True).returncode != 0:
        return rh
    rb = _module_at(rev, "tpdiag/kernels/record_hash_batch.py", "_hv_record_hash_batch")
    rb.rh = rh
    return rb


def _tensor(shape, dtype: str, misalign: int):
    """A CPU tensor of `shape` whose data pointer is `misalign` bytes past a 16-byte boundary
    (never written, never launched on)."""
    import torch

    dt = getattr(torch, dtype)
    n = 1
    for s in shape:
        n *= s
    es = torch.empty((), dtype=dt).element_size()
    pad = 64 // es
    buf = torch.empty(n + pad, dtype=dt)
    skip = (-buf.data_ptr() % 16 + misalign) // es
    return buf[skip:skip + n].view(shape)


def compile_keys(rh, kernel: str, t, dim, full, offset, rb=None) -> tuple | None:
    """The Triton compile key of hashing `t` (a shard placed by dim/full/offset) through
    `kernel`'s launch path of record-hash module `rh` (its batched launch in `rb`, record_hash_batch;
    None: rh's own where it has one, as before that module, else this checkout's); None where no
    Triton kernel runs."""
    import torch

    # rh.triton_ok's test but for the device (the tensors here are the CPU's)
    if t.dtype not in rh._TRITON_T or t.numel() < getattr(rh, "TRITON_MIN_NUMEL", 1):
        return None
    seen = []
    direct, cuda_raw = rh._direct, None
    try:
        rh._direct = lambda key, grid, args, device, jit: seen.append(key)
        ints, floats = torch.zeros(1, 4, dtype=torch.int64), torch.zeros(1, 2, dtype=torch.float64)
        if kernel == "batch":
            if rb is None:
                rb = rh if hasattr(rh, "batch_entry") else importlib.import_module("tpdiag.kernels.record_hash_batch")
            key, _words, _row = rb.batch_entry(t, dim, full, offset, 0)
            table = torch.zeros(1, rb.TABLE_COLS, dtype=torch.int64)
            rb.batch_launch(key, table, 1, 4, ints, floats)
            # ("batch", device, key, (PAIRS, MIX), warps, table / ints / floats aligned, cap):
            # the three bookkeeping buffers are the HashBuffer's, always aligned
            ck = seen[0]
            return ("_hash_batch_kernel", ck[2], ck[3], ck[4], ck[-1])
        a, L, b, F, o = rh.slab(t.shape, dim, full, offset)
        rh.triton_lanes(t, a, L, b, F, o, (ints, floats, 0))
        # ("one", device, constexprs, warps, words / ints / floats aligned, SLAB == 1, SLAB % 16,
        # int32 integers, cap)
        ck = seen[0]
        return ("_hash_kernel", ck[2], ck[3], ck[4]) + tuple(ck[7:])
    finally:
        rh._direct = direct


def count(rev: str | None, records: list[dict]) -> dict:
    rh = _module_at(rev, "tpdiag/kernels/record_hash.py", "_hv_record_hash")
    rb = _batch_at(rev, rh)
    warm = _module_at(rev, "tpdiag/runner/warm.py", "_hv_warm")
    keys: dict = {}
    for r in records:
        t = _tensor(r["shape"], r["dtype"], r.get("misalign", 0))
        k = compile_keys(rh, r["kernel"], t, r["dim"], r["full"], r["offset"], rb)
        if k is not None:
            keys.setdefault(k, []).append(r)
    dtypes = sorted({r["dtype"] for r in records if r["dtype"] in ("float32", "bfloat16", "float16")},
                    key=lambda d: d != "bfloat16")
    warmed = set()
    for kind, name, i in (s for s in warm.plan(dtypes) if s[0] in ("batch", "one")):
        shape, dim, full = warm.SHAPES[i]
        k = compile_keys(rh, kind, _tensor(shape, name, 0), dim, full, 0, rb)
        if k is not None:
            warmed.add(k)
    by_kernel: dict = {}
    for k in keys:
        by_kernel.setdefault(k[0], 0)
        by_kernel[k[0]] += 1
    return {"rev": rev or "checkout", "variants": len(keys), "by_kernel": by_kernel,
            "warm_steps": len(warmed), "warm_variants": len(warmed), "not_warmed": sum(1 for k in keys if k not in warmed),
            "keys": [{"key": repr(k), "records": sum(r["records"] for r in rs), "warmed": k in warmed,
                      "example": {x: rs[0][x] for x in ("kernel", "shape", "dtype", "dim", "full")}}
                     for k, rs in sorted(keys.items(), key=lambda kv: repr(kv[0]))]}


def main(argv) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks hash-variants")
    p.add_argument("records", nargs="?", default=DEFAULT)
    p.add_argument("--base", default=None, help="also count at this git revision (before/after)")
    a = p.parse_args(argv)
    with open(a.records) as f:
        records = [json.loads(line) for line in f if line.strip()]
    out = {"records_file": os.path.relpath(a.records, ROOT), "distinct_records": len(records),
           "records": sum(r["records"] for r in records)}
    runs = [count(None, records)]
    if a.base:
        runs.insert(0, count(a.base, records))
    for run in runs:
        print(f"== {run['rev']}: {run['variants']} compiled variants {run['by_kernel']}; the warm-up compiles "
              f"{run['warm_variants']}, {run['not_warmed']} of the records' are not among them")
        for k in run["keys"]:
            print(f"  {'warm' if k['warmed'] else 'COLD'} {k['records']:4d} records  {k['key']}  e.g. {k['example']}")
    out["runs"] = runs
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
