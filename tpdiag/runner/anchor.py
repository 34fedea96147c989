"""Re-anchoring a later step at the reference's state (`compare --steps N`: on by default, `--no-anchor` off).

From step 1 on each side's weights are its own update's: a TP=N world's records of step k differ from
the reference's by the updates' drift as well as by step k's own code, and no bound separates the two
(docs/causes.md, "Later steps"). With the anchor on, the reference world saves the state its step k
starts from (parameters, AdamW's moments and step count, floating buffers) before each step k >= 1,
and a TP=N world loads it before its own step k, each tensor cut to the shard its DTensor layout holds
(the same placements that sharded the initial weights) - so step k's records compare with the
reference's from the same weights, as step 0's do: the float64 re-executions and bounds apply again.
The world runs every step (a module's own Python state - a step counter - advances as it would); only
the tensors are replaced. A state it cannot place bitwise (a plain local tensor shaped unlike the
reference's: a hand-sharded layer; an optimizer other than the tool's AdamW state) is not loaded at
all: the world says so (world.json `anchor`) and its later steps are the drifted ones (the old path).
So is a state too large to write every later step of (over TPDIAG_ANCHOR_MAX_MB: the reference saves
none and says why in `anchor/refused.txt`).

Not loaded, each world's own: integer and bool buffers, and the RNG state. Neither is recorded (the
probes record the floating buffers a step wrote), so a world that advanced a count wrongly (a token
counter of the rank's shard) shows it only where a later step's forward reads it; loading the
reference's count erased that symptom and the bug read rounding (tests/test_int_buffer_steps.py). The
RNG: a TP > 1 world draws for its shards (fewer numbers a rank, or DTensor's offset-based tracker on
CUDA), so the reference's generator state is no state it would have drawn from, and loading it on
every rank would hide ranks whose streams diverged, which nothing else records.
"""
from __future__ import annotations

import os

ANCHOR_DIR = "anchor"  # in the reference's world folder: one file per later step
REFUSED = "refused.txt"  # beside them where the reference saved none: why (a TP > 1 world's why)
# the whole run's state files (every later step's) the reference writes at most; past it it saves none
MAX_MB_ENV, MAX_MB = "TPDIAG_ANCHOR_MAX_MB", 8192


def state_file(ref_dir: str, step: int) -> str:
    return os.path.join(ref_dir, ANCHOR_DIR, f"step{step}.safetensors")


def clear(ref_dir: str) -> None:
    import shutil

    shutil.rmtree(os.path.join(ref_dir, ANCHOR_DIR), ignore_errors=True)


def state_bytes(model) -> int:
    """One saved step's bytes: each parameter whole and AdamW's two moments of its size, the floating
    buffers (a DTensor's numel is the whole tensor's: every rank of the reference computes the same)."""
    n = sum(3 * p.numel() * p.element_size() for p in model.parameters())
    return n + sum(b.numel() * b.element_size() for b in model.buffers() if b.is_floating_point())


def max_mb() -> int:
    """TPDIAG_ANCHOR_MAX_MB (MiB; unset or empty: MAX_MB). A value that is no whole number is BadInput,
    which compare checks before any world (runner/checks.py): `abc` read as the default and `-5` as a
    cap no state passes, each silently - the user's cap was not the one applied."""
    from tpdiag.base.env import whole

    return whole(MAX_MB_ENV, MAX_MB, " of MiB")


def over_budget(cfg, model) -> str | None:
    """Why the reference saves no state (every later step's file would pass TPDIAG_ANCHOR_MAX_MB:
    llama-1b's float32 state is ~15 GB a step), or None. Shapes alone decide it, so every rank of a
    TP > 1 reference decides alike (its saves are collectives)."""
    cap = max_mb()
    total = (cfg.steps - 1) * state_bytes(model)
    if total <= cap << 20:
        return None
    return (f"the reference saved no state: {cfg.steps - 1} steps' states take {total / 2**30:.1f} GiB, over "
            f"{MAX_MB_ENV}={cap}")


def refuse(ref_dir: str, why: str) -> None:
    os.makedirs(os.path.join(ref_dir, ANCHOR_DIR), exist_ok=True)
    with open(os.path.join(ref_dir, ANCHOR_DIR, REFUSED), "w", encoding="utf-8") as f:
        f.write(why)


def saves(cfg) -> bool:
    """The reference world of an anchored run with later steps saves its state before each."""
    return bool(cfg.anchor) and cfg.backward and cfg.steps > 1 and not cfg.ref_dir


def loads(cfg) -> bool:
    """A TP > 1 world of an anchored run loads the reference's state before each later step (a
    reference rerun - the determinism check - and a TP=1 configuration keep their own)."""
    return bool(cfg.anchor) and cfg.backward and cfg.steps > 1 and bool(cfg.ref_dir) and cfg.point.tp > 1


def _whole(t):
    """The full tensor of a parameter or buffer (a DTensor's gathered: the reference's are plain)."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def save(path: str, model, opt, write: bool = True) -> None:
    """The state step k starts from, whole, on the host, as safetensors (never a pickle: docs/security.md):
    `params/<name>`, `moments/<name>/<state key>` (AdamW's exp_avg, exp_avg_sq, step), `buffers/<name>`
    (floating ones). Called on EVERY rank of the reference world: a reference at TP > 1 holds DTensors,
    whose full_tensor is a collective every rank joins (rank 0 alone gathering hung the world until its
    timeout: `--tp 2,4 --steps 2 --anchor`), each in the same order (the model's parameters, not the
    optimizer's dict); only the rank with `write` writes. A state value that is no tensor is not saved:
    the loading world then finds the keys differ and loads nothing."""
    import torch
    from safetensors.torch import save_file

    flat = {}

    def keep(key, t):
        t = _whole(t).detach()
        if write:
            flat[key] = t.cpu().contiguous().clone()

    with torch.no_grad():
        for n, p in model.named_parameters():
            keep(f"params:{n}", p)
        for n, p in model.named_parameters():
            st = opt.state.get(p) if opt is not None else None
            for k in sorted(st or ()):
                if isinstance(st[k], torch.Tensor):
                    keep(f"moments:{n}:{k}", st[k])
        for n, b in model.named_buffers():
            if b.is_floating_point():
                keep(f"buffers:{n}", b)
    if not write:
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    save_file(flat, tmp)
    os.replace(tmp, path)


def _read(path: str) -> dict:
    """{params: {name: t}, moments: {name: {key: t}}, buffers: {name: t}} from save's file."""
    from safetensors.torch import load_file

    out: dict = {"params": {}, "moments": {}, "buffers": {}}
    for key, t in load_file(path).items():
        # "part:name" ("moments:name:key"): ':' is in no parameter, buffer or optimizer-state name,
        # and the file's keys are no record keys (records/keys.py owns those and their '/')
        part, _, rest = key.partition(":")
        if part == "moments":
            name, _, k = rest.rpartition(":")
            out["moments"].setdefault(name, {})[k] = t
        elif part in out:
            out[part][rest] = t
    return out


def _shard(whole, like):
    """`whole` cut to what `like` holds on this rank: a DTensor's local shard by its placements (no
    collective: every rank has the whole tensor), a plain tensor as is where its shape is the
    reference's; None where neither (a hand-sharded tensor: no layout says which part is this rank's)."""
    from torch.distributed.tensor import DTensor

    if isinstance(like, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        if tuple(like.shape) != tuple(whole.shape):
            return None
        shape, offset = compute_local_shape_and_global_offset(like.shape, like.device_mesh, like.placements)
        part = whole[tuple(slice(o, o + s) for o, s in zip(offset, shape))]
        local = like.to_local()
        return part if tuple(part.shape) == tuple(local.shape) else None
    return whole if tuple(whole.shape) == tuple(like.shape) else None


def _into(dst, src) -> None:
    local = getattr(dst, "_local_tensor", dst)
    local.copy_(src.to(device=local.device, dtype=local.dtype))


def plan_load(path: str, model, opt) -> tuple[list, str | None]:
    """([(destination, its shard)], None), or ([], why) where some tensor of the saved state has no
    place in this world that reproduces it bitwise (then nothing is loaded)."""
    import torch

    saved = _read(path)
    pairs = []
    params = dict(model.named_parameters())
    if set(params) != set(saved["params"]):
        return [], "its parameters are not the reference's by name"
    for n, p in params.items():
        part = _shard(saved["params"][n], p)
        if part is None:
            return [], f"parameter {n}: shaped {list(p.shape)} here, {list(saved['params'][n].shape)} at the reference"
        pairs.append((p, part))
    buffers = {n: b for n, b in model.named_buffers() if b.is_floating_point()}
    if set(buffers) != set(saved["buffers"]):
        return [], "its floating buffers are not the reference's by name"
    for n, b in buffers.items():
        part = _shard(saved["buffers"][n], b)
        if part is None:
            return [], f"buffer {n}: shaped {list(b.shape)} here, {list(saved['buffers'][n].shape)} at the reference"
        pairs.append((b, part))
    moments = []
    for n, st in saved["moments"].items():
        p = params[n]
        here = opt.state.get(p) if opt is not None else None
        if not here or set(here) != set(st):
            return [], f"the optimizer state of {n} is not the reference's (its keys)"
        for k, v in st.items():
            if not isinstance(v, torch.Tensor) or not isinstance(here[k], torch.Tensor):
                return [], f"the optimizer state {n}.{k} is not a tensor"
            part = _shard(v, here[k]) if v.dim() else v
            if part is None:
                return [], f"the optimizer state {n}.{k}: shaped unlike the reference's"
            moments.append((here[k], part))
    if opt is not None and set(saved["moments"]) != {n for n, p in params.items() if opt.state.get(p)}:
        return [], "the optimizer holds state for other parameters than the reference's"
    return pairs + moments, None


def load(path: str, model, opt) -> str | None:
    """Load the reference's state before a later step; None, or why nothing was loaded - on no rank
    of the world (agreed)."""
    import torch

    pairs, why = [], split_replicas(model)  # a collective: every rank, before any rank's own answer
    refused = os.path.join(os.path.dirname(path), REFUSED)
    if why is None and not os.path.isfile(path):
        if os.path.isfile(refused):
            with open(refused, encoding="utf-8") as f:
                why = f.read(500).strip() or "the reference saved no state"
        else:
            why = f"the reference saved no state for this step ({path})"
    elif why is None:
        try:
            pairs, why = plan_load(path, model, opt)
        except Exception as e:  # noqa: BLE001 - an unreadable file: this rank refuses, and says so to the others
            why = f"its state file cannot be read ({type(e).__name__}: {e})"
    why = agreed(why)
    if why:
        return why
    with torch.no_grad(), torch._C.DisableTorchFunction():
        for dst, src in pairs:
            _into(dst, src)
    # no mark_recorded: the last update's records are not what this step reads, so a parameter loaded
    # here reads as written since its record (probes/own_params.written_since_recorded) and no record
    # of it is shipped as this side's own
    return None


def split_replicas(model) -> str | None:
    """Why not to load: a plain floating buffer whose copies differ across this world's ranks (a
    per-rank statistic, a bias nudged from each rank's own experts' load), or None. Loading the
    reference's value on every rank would erase what a later step reads of it - the only evidence that
    tells a per-rank state a step reads (a bug) from one nobody reads (diff/replicas.py): with it
    loaded, load_stats.py:read and balance_bias.py:local_load read `unknown` instead of
    rank-inconsistent-replica. Every rank gets the same answer (the digests are gathered)."""
    import hashlib

    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    mine = []
    with torch.no_grad(), torch._C.DisableTorchFunction():
        for n, b in model.named_buffers():
            if b.is_floating_point() and not isinstance(b, DTensor):
                raw = b.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                mine.append((n, hashlib.sha256(raw).hexdigest()))
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    for i, (n, _) in enumerate(every[0]):
        if any(len(o) != len(every[0]) or o[i] != every[0][i] for o in every[1:]):
            return (f"buffer {n} differs across this world's ranks: the reference's value would replace the "
                    "per-rank one a later step reads")
    return None


def agreed(why: str | None) -> str | None:
    """Every rank's answer made one: None where every rank can load, else the first refusing rank's
    why (naming it). Each rank decides on its own tensors and rank 0 alone writes world.json's
    `anchor`: a rank that refused (a parameter it alone holds, an optimizer state it alone lacks: a
    grad that never reached it) while rank 0 loaded once left world.json saying `anchored` over a
    step that rank ran from its own drifted weights - read with the reference's weights at both
    sides (diff/anchored.py), its drift judged as its own code's. So a world loads on all ranks or
    on none."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return why
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, why)
    bad = next(((r, w) for r, w in enumerate(every) if w), None)
    return None if bad is None else f"rank {bad[0]}: {bad[1]}"
