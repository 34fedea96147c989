"""Compile the record-hash kernels' usual variants ahead of the worlds, into Triton's on-disk cache.

Each distinct (dtype, tile plan, alignment) of a record is a variant of `_hash_kernel` or
`_hash_batch_kernel` that Triton compiles the first time a process launches it: 1-2.5 s each on
an H200 host, one after another, inside the world that first meets it. On a fresh machine a
llama-1b compare's first world compiled 7 of them (12 s of its 17.5 s) and its second pass's
first world 4 more (H200, `compare --set axes --only mb-8x4096`, TPDIAG_COMPILE_LOG). A later
process finds them in the cache and loads each in ~2 ms.

`start()` runs `warm()` in a few background processes while the parent checks its inputs: each
hashes a slice of small tensors, one of each variant a language model's records use (whole
tensors big and small, scalars, last-dim shards), through the same launch paths the probes take,
so Triton keys them as the worlds will. Nothing they compute is
kept; a variant they miss compiles where it is met, as before. TPDIAG_WARM=0: off (A/B).
"""
from __future__ import annotations

import os

# (shape, split dim or None, the split dim's full size) - each a tile plan (record_hash.plan)
# the probes meet in a language model: whole tensors past a chunk (even, not even, odd word
# counts), between one tile and a chunk, smaller than a tile (norm weights, per-head norms,
# scalars: the loss, the grad norm), and shards split on their last dim (rows of a
# column-parallel output at TP > 1) with as many rows as a chunk's tiles and not.
_BIG = 4 * 16384
# the ones a first world meets first lead (each process takes every n-th: they start side by side)
SHAPES = (((_BIG,), None, None), ((1,), None, None), ((2048,), None, None), ((64, 1024), 1, 2048),
          ((_BIG + 16,), None, None), ((128,), None, None), ((1024,), None, None), ((_BIG + 2,), None, None),
          ((_BIG + 1,), None, None), ((3000,), None, None), ((64,), None, None), ((5, 1024), 1, 2048),
          ((64, 2048), 1, 4096), ((64, 64), 1, 128), ((64, 16384), 1, 32768))


def jobs(dtypes: list[str]) -> list[tuple[str, int]]:
    """(dtype, shape index) of every tensor to hash, each through both launch paths."""
    return [(d, i) for i in range(len(SHAPES)) for d in dtypes]


def start(ctx, dtypes, procs: int | None = None) -> list:
    """Background processes warming the cache for these dtypes (names: 'bfloat16'), started from
    `ctx` - the fork server the worlds start from (runner/launch.py), so that they import, key and
    store the kernels exactly as a world does (started as a fresh interpreter they compiled under
    the same in-memory key, yet no world found what they stored). [] where off. Daemons: each ends
    when its slice is done (seconds), or with this process."""
    if os.environ.get("TPDIAG_WARM", "1") == "0":
        return []
    names = sorted({str(d).replace("torch.", "") for d in dtypes} & {"float32", "bfloat16", "float16"})
    if not names:
        return []
    n = len(jobs(names))
    # each holds a CUDA context (~0.5 GiB of GPU 0) while the memory preflight reads what is free:
    # few, so that it under-reads by little. Eight were no faster than four on a fresh 2x H200
    # (llama-1b TP=1,2 at 6ae20d6: 15.9 s of compiles inside the worlds against 14.6 s, one run
    # each): the worlds meet the variants sooner than either finishes. TPDIAG_WARM_PROCS=N: N (A/B)
    procs = procs or _procs(n)
    out = []
    for part in range(procs):
        try:
            p = ctx.Process(target=warm, args=(names, part, procs), daemon=True)
            p.start()
        except Exception:  # noqa: BLE001 - a warm-up is never the run's failure
            break
        out.append(p)
    return out


def _procs(n: int) -> int:
    knob = os.environ.get("TPDIAG_WARM_PROCS", "")
    if knob:
        try:  # a developer's A/B knob, read in a background thread: a bad value is the default
            return max(1, min(n, int(knob)))
        except ValueError:
            pass
    return max(1, min(n, (os.cpu_count() or 2) // 2, 4))


def warm(names: list[str], part: int, parts: int) -> int:
    """Hash this part's slice of the tensors on the first visible GPU; returns how many it hashed."""
    import torch

    from tpdiag.kernels import record_hash as rh
    from tpdiag.kernels.hash_buffer import HashBuffer

    from tpdiag.runner.compile_time import compile_meter

    dev = torch.device("cuda", 0)
    done = 0
    with compile_meter("cuda"):  # TPDIAG_COMPILE_LOG: these compiles logged as a world's are
        for k, (name, i) in enumerate(jobs(names)):
            if k % parts != part:
                continue
            shape, dim, full = SHAPES[i]
            t = torch.zeros(shape, dtype=getattr(torch, name), device=dev)
            if not rh.triton_ok(t):
                return done
            rh.shard_lanes(t, dim, full, 0)  # one record alone: _hash_kernel
            hb = HashBuffer(dev)
            hb.add(t, dim, full, 0)  # queued records: _hash_batch_kernel
            hb.flush()
            done += 1
        torch.cuda.synchronize(dev)
    return done
