"""Compile the record-hash kernels' usual variants ahead of the worlds, into Triton's on-disk cache.

Each distinct (dtype, tile plan, alignment) of a record is a variant of `_hash_kernel` or
`_hash_batch_kernel` that Triton compiles the first time a process launches it: 1-2.5 s each on
an H200 host, one after another, inside the world that first meets it. On a fresh machine a
llama-1b compare's first world compiled 7 of them (12 s of its 17.5 s) and its second pass's
first world 4 more (H200, `compare --set axes --only mb-8x4096`, TPDIAG_COMPILE_LOG). A later
process finds them in the cache and loads each in ~2 ms.

`start()` runs `warm()` in a few background processes while the parent checks its inputs: they
take the steps of `plan()` in turn - hash a small tensor of each variant a language model's
records use (whole tensors big and small, scalars, last-dim shards) through the same launch paths
the probes take, the batch kernel's first; and, where the run will confirm with
tp-invariant-linear, run that fix's GEMMs on zeros of the model's shapes, last (the confirmation
comes after the second pass; on a fresh 2x H200 its TP=1 world compiled them itself, 2.8-4.3 s).
Triton keys them as the worlds will. Nothing they compute is kept; a variant they miss compiles
where it is met, as before. TPDIAG_WARM=0: off (A/B).
"""
from __future__ import annotations

import os

# (shape, split dim or None, the split dim's full size) - one a compiled variant of each kernel
# (record_hash.plan's layouts; since 58bc672 a record's sizes pick no variant of their own: EVEN,
# the tile's rows and columns are runtime values): a tensor tiled along its one slab (slabs of a
# chunk or more: most records), a dense last-dim shard (slabs a power of two up to a tile: a
# column-parallel output at TP > 1), a strided one (and a whole tensor shorter than a chunk: one
# such slab), and an odd-sized whole tensor (SLAB % 16 != 0: the one-record kernel's
# specialisation; 16-bit data read element by element in both). A llama compare's records meet
# 4 variants of each kernel at TP=1,2, all here (`python -m benchmarks hash-variants`; before
# 58bc672 they met 11 and the warm-up's 15 shapes compiled 45)
_BIG = 4 * 16384
# the ones a first world meets first lead (each process takes every n-th: they start side by side)
SHAPES = (((_BIG,), None, None), ((2048,), None, None), ((64, 1024), 1, 2048), ((64, 2048), 1, 4096),
          ((_BIG + 1,), None, None))


def plan(names: list[str], gemm: tuple | None = None, gemm_first: bool = False) -> list[tuple]:
    """The warm-up's steps in the order they are taken (process k of n takes steps k, k + n, ...):
    ("batch", dtype, shape index) - `_hash_batch_kernel`, what a world's records meet first (a
    first-pass world's own compiles on a fresh 2x H200 were batch-kernel variants, 2-3 a world,
    docs/gpu_runs/compile-log-0428e29.txt) - for every shape, the first dtype (the model's) first;
    then ("one", dtype, shape index) - `_hash_kernel`, a record hashed alone (a stored tensor's
    check, a record off the queue), which the first worlds met later and only loaded; then, where
    the run's confirmation will rerun with tp-invariant-linear, ("gemm", spec): its invariant
    GEMM variants (gemm_spec), last - the confirmation comes after the second pass, so they are
    compiled behind it instead of before the hash variants every world needs (gemm_first: the
    fix runs from the first pass on, --fix, so they lead)."""
    steps: list[tuple] = [("batch", d, i) for i in range(len(SHAPES)) for d in names]
    steps += [("one", d, i) for i in range(len(SHAPES)) for d in names]
    if gemm is not None:
        steps.insert(0, ("gemm", gemm)) if gemm_first else steps.append(("gemm", gemm))
    return steps


def gemm_spec(cfg) -> tuple[tuple | None, bool]:
    """(spec, first) of the tp-invariant-linear GEMMs this compare's worlds will run, for the
    warm-up: (model preset, plan variant, dtype, batch, seq, local tree groups of the reference
    degree, one GEMM per group); first: the fix is on from the first pass. (None, False) where
    no world will run the fix's Triton GEMMs as far as the input says (no confirmation, a fix
    that is not it, a model that is not a built-in preset: its layout is known only once built)."""
    from tpdiag.fixes import groups as tree_groups
    from tpdiag.fixes.linear import TREE
    from tpdiag.models.presets import PRESETS

    if cfg.model not in PRESETS:
        return None, False
    first = TREE in cfg.fixes
    if not first and not (cfg.confirm and cfg.fix_mode in ("none", "auto")):
        return None, False
    g, gemm = tree_groups.choose(cfg.degrees, cfg.tree_groups or None)
    ref = min(cfg.degrees)
    return (cfg.model, cfg.variant, str(cfg.dtype).replace("torch.", ""), cfg.batch_size, cfg.seq_len,
            max(1, g // ref), gemm == tree_groups.PER_GROUP, bool(cfg.backward)), first


def linear_shapes(preset: str, variant: str = "stock") -> list[tuple[str, int, int]]:
    """(style, in_features, out_features) of every distinct Linear the tp-invariant-linear fix
    wraps in a built-in preset (one layer: every layer's are the same), from the model built on
    the meta device and the plan, as the fix finds them (fixes/linear._targets)."""
    import torch

    from tpdiag.fixes.linear import _targets
    from tpdiag.models.plans import llama_plan
    from tpdiag.models.tiny_llama import PRESETS, LlamaConfig, TinyLlama

    with torch.device("meta"):
        model = TinyLlama(LlamaConfig(**{**PRESETS[preset], "n_layers": 1}))
    return sorted({(style, m.in_features, m.out_features) for _, m, style, _ in _targets(model, llama_plan(variant))})


# The GEMM warm-up's operands stay under this (GPU 0 is the reference world's too): a Linear
# whose tensors would be larger is left to compile where it is met
GEMM_BYTES = 1 << 30


def warm_gemms(spec: tuple, device) -> int:
    """Forward and backward of each Linear tp-invariant-linear wraps (linear_shapes), on zeros of
    the world's shapes, through the fix's own autograd Functions (kernels/grouped_linear.py) under
    the run's tree groups - so that Triton keys the invariant GEMM's variants as the reference
    degree's world will: its K (specialised), its M * N * K (TMA or the pointer kernel), the
    operands' transposes, an fp32 or 16-bit output. Returns how many Linears it ran."""
    import torch

    from tpdiag.kernels.grouped_linear import ColLinear, RowLinearPartial
    from tpdiag.kernels.tree import install_tree_groups, tree_all_reduce

    preset, variant, dtype, batch, seq, groups, per_group, backward = spec
    dt = getattr(torch, dtype)
    done = 0
    with install_tree_groups(groups, per_group):
        for style, k, n in linear_shapes(preset, variant):
            if (batch * seq * (k + 2 * n) + n * k * 2) * 4 > GEMM_BYTES:
                continue
            x = torch.zeros((batch, seq, k), dtype=dt, device=device, requires_grad=backward)
            w = torch.zeros((n, k), dtype=dt, device=device, requires_grad=backward)
            if style == "rowwise":
                y = tree_all_reduce(RowLinearPartial.apply(x, w, groups, None), dt)
            else:  # column-parallel (and colwise-gathered): tp-invariant-linear's tree dgrad
                y = ColLinear.apply(x, w, groups, False, True, None)
            if backward:
                torch.autograd.backward(y, torch.zeros_like(y))  # a contiguous grad, as a model's
            done += 1
    return done


def start(ctx, dtypes, procs: int | None = None, gemm: tuple | None = None, gemm_first: bool = False) -> list:
    """Background processes warming the cache for these dtypes (names: 'bfloat16'; the first
    leads the plan), and the GEMMs of `gemm` (gemm_spec), started from
    `ctx` - the fork server the worlds start from (runner/start_context.py), so that they import, key and
    store the kernels exactly as a world does (started as a fresh interpreter they compiled under
    the same in-memory key, yet no world found what they stored). [] where off. Daemons: each ends
    when its slice is done (seconds), or with this process."""
    if os.environ.get("TPDIAG_WARM", "1") == "0":
        return []
    names = list(dict.fromkeys(n for n in (str(d).replace("torch.", "") for d in dtypes)
                               if n in ("float32", "bfloat16", "float16")))
    if not names:
        return []
    steps = plan(names, gemm, gemm_first)
    n = len(steps)
    # each holds a CUDA context (~0.5 GiB of GPU 0) while the memory preflight reads what is free:
    # few, so that it under-reads by little. Eight were no faster than four on a fresh 2x H200
    # (llama-1b TP=1,2 at 6ae20d6: 15.9 s of compiles inside the worlds against 14.6 s, one run
    # each): the worlds meet the variants sooner than either finishes. TPDIAG_WARM_PROCS=N: N (A/B)
    procs = procs or _procs(n)
    out = []
    for part in range(procs):
        try:
            p = ctx.Process(target=warm, args=(steps, part, procs), daemon=True)
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


def warm(steps: list[tuple], part: int, parts: int) -> int:
    """Take this part's steps of the plan (plan()) on the first visible GPU; returns how many it took."""
    import torch

    from tpdiag.kernels import record_hash as rh
    from tpdiag.kernels.hash_buffer import HashBuffer

    from tpdiag.runner.compile_time import compile_meter

    dev = torch.device("cuda", 0)
    done = 0
    with compile_meter("cuda"):  # TPDIAG_COMPILE_LOG: these compiles logged as a world's are
        for k, step in enumerate(steps):
            if k % parts != part:
                continue
            if step[0] == "gemm":
                try:
                    warm_gemms(step[1], dev)
                except Exception:  # noqa: BLE001 - what it missed compiles where it is met
                    continue
                done += 1
                continue
            kind, name, i = step
            shape, dim, full = SHAPES[i]
            t = torch.zeros(shape, dtype=getattr(torch, name), device=dev)
            if not rh.triton_ok(t):
                return done
            if kind == "one":
                rh.shard_lanes(t, dim, full, 0)  # one record alone: _hash_kernel
            else:
                hb = HashBuffer(dev)
                hb.add(t, dim, full, 0)  # queued records: _hash_batch_kernel
                hb.flush()
            done += 1
        torch.cuda.synchronize(dev)
    return done
