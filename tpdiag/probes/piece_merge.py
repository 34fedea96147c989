"""A micro-batched or decoded step's piece records merged into the whole step's (probes/pieces.py
places each piece): full capture concatenates the pieces' slices, hash capture adds their lanes,
a per-call value every piece shares is kept once where it is one value on every rank, and a
parameter's grad keeps its last record (it accumulates in place over the pieces).
"""
from __future__ import annotations

import torch

PHASE_RANK = {"init": 0, "forward": 1, "loss": 2, "backward": 3, "optimizer": 4}


def merge(rec) -> None:
    """rec's records with every piece's records merged into the whole step's, in place."""
    from tpdiag.probes.stream import finish

    records = rec.records
    lanes = list(rec.lanes)
    if not any("piece" in m for m, _ in records):
        return
    finish(records)  # full capture: every piece's host copy complete, its hash known
    groups: dict[str, list[int]] = {}
    for i, (m, _) in enumerate(records):
        if "piece" in m:
            groups.setdefault(m["key"], []).append(i)
    # whether each key's pieces hold one value, decided alike on every rank (the records each
    # rank writes must be the same list: a collective's pieces can be equal on one rank only)
    full = [ms for ms in groups.values() if records[ms[0]][1] is not None
            and records[ms[0]][0]["kind"] != "param_grad"]
    # hash capture: a per-call value (piece_const) is one value only if every piece's lanes agree
    const = [ms for ms in groups.values() if records[ms[0]][1] is None
             and records[ms[0]][0].get("piece_const") and records[ms[0]][0]["kind"] != "param_grad"]
    flags = _agree(rec, [_same(rec, [records[j] for j in ms]) for ms in full]
                   + _same_lanes(rec, [[records[j][0] for j in ms] for ms in const],
                                 [[lanes[j] for j in ms] for ms in const]))
    same = {ms[0]: f for ms, f in zip(full + const, flags)}
    experts = {m["module"] for m, _ in records if m.get("style") in EXPERT_STYLES}
    inside: dict[str, set] = {}  # experts module -> its submodules left out
    out = []  # (sort key, meta, tensor, lane)
    for i, (m, t) in enumerate(records):
        if "piece" not in m:
            out.append(((m["step"], PHASE_RANK.get(m["phase"], 5), i), m, t, lanes[i]))
            continue
        members = groups.get(m["key"])
        if members is None or members[0] != i:
            continue  # merged with its key's first piece
        block = _experts_of(m, experts) if len(members) > 1 else None
        if block is not None:
            inside.setdefault(block, set())
            if m["module"] != block:
                inside[block].add(m["module"])
            continue
        if m["kind"] == "param_grad":  # accumulated in place over the pieces: the last is the step's
            j = members[-1]
            mm = {k: v for k, v in records[j][0].items() if k != "piece"}
            out.append(((m["step"], PHASE_RANK["backward"], j), mm, records[j][1], lanes[j]))
            continue
        for meta, tensor, lane in _merged(rec, [records[j] for j in members], [lanes[j] for j in members],
                                          same.get(i, False)):
            out.append(((m["step"], PHASE_RANK.get(m["phase"], 5), i), meta, tensor, lane))
    out.sort(key=lambda x: x[0])
    marked = set()
    for _, m, _, _ in out:
        if m["module"] in inside and m["module"] not in marked:
            # the diff leaves the reference's records inside it out too (diff/engine.py)
            m["per_piece_inside"] = sorted(inside[m["module"]])
            marked.add(m["module"])
    rec._records[:] = []
    rec.lanes[:] = []
    for n, (_, m, t, lane) in enumerate(out):
        m["idx"] = n
        rec._records.append((m, t))
        rec.lanes.append(lane)


def last_grads(rec) -> int:
    """Keep only the last record of each parameter's grad in a step; returns how many were dropped.
    A user's own step that accumulates grads over micro-batches (several backward calls under
    `tpdiag.capture`) records each parameter's grad after every backward, under one key: the grad
    accumulates in place, so the last is the step's - as merge keeps for compare's own pieces. The
    earlier ones made the capture unreadable ("record ... listed twice")."""
    from tpdiag.probes.stream import finish

    records = rec.records
    last = {m["key"]: i for i, (m, _) in enumerate(records) if m["kind"] == "param_grad"}
    drop = {i for i, (m, _) in enumerate(records) if m["kind"] == "param_grad" and last[m["key"]] != i}
    if not drop:
        return 0
    finish(records)  # full capture: every host copy complete before any record goes
    lanes = list(rec.lanes)
    kept = [(m, t, lanes[i]) for i, (m, t) in enumerate(records) if i not in drop]
    rec._records[:] = []
    rec.lanes[:] = []
    for n, (m, t, lane) in enumerate(kept):
        m["idx"] = n
        rec._records.append((m, t))
        rec.lanes.append(lane)
    return len(drop)


# an MoE experts module (transformers' experts: moe_tp_experts in the plan, whose style every
# degree records, TP=1 too)
EXPERT_STYLES = ("moeexpertsparallel",)


def _experts_of(m: dict, experts: set):
    """The experts module whose dispatch `m` is inside (its ops, its submodules' records), else None.
    There the rows are the call's (token, slot) pairs grouped by expert: a piece's rows are no slice
    of the whole call's (concatenated they are in another order; a piece holds another number per
    expert), unlike the module's own inputs, output and grads, which are per token and compared."""
    mod = m["module"]
    if m["kind"] == "op" and mod in experts:
        return mod
    return next((e for e in experts if mod.startswith(e + ".")), None)


def _same(rec, parts: list) -> bool:
    """Whether one key's pieces (full capture) are one value: bitwise equal, and not a record
    that grew call by call (grows: only its first calls were kept)."""
    from tpdiag.probes.stream import as_tensor

    if parts[0][0]["key"] in rec.piece_varying:
        return False
    ts = [as_tensor(t) for _, t in parts]
    return all(x.shape == ts[0].shape and x.dtype == ts[0].dtype for x in ts) and all(
        torch.equal(_bits(x), _bits(ts[0])) for x in ts[1:])


def _same_lanes(rec, metas: list, slots: list) -> list:
    """Per key of hash capture's per-call values: whether every piece hashed to the same lanes
    (one read of the rows at the step's end), with the same shape and not grown call by call."""
    from tpdiag.kernels.hash_buffer import STALE

    flat = [s for ss in slots for s in ss]
    if not flat:
        return []
    ints = rec.hashbuf.take_lanes(flat)[0].cpu()
    out, at = [], 0
    for ms, ss in zip(metas, slots):
        rows = ints[at:at + len(ss)]
        at += len(ss)
        out.append(ms[0]["key"] not in rec.piece_varying
                   and all(m.get("local_shape") == ms[0].get("local_shape") for m in ms)
                   and bool((rows[:, 2] != STALE).all()) and bool((rows[:, :2] == rows[0, :2]).all()))
    return out


def _agree(rec, flags: list) -> list:
    """flags ANDed over the world's ranks (one collective), where every rank has as many."""
    import torch.distributed as dist

    if rec.world <= 1 or not dist.is_initialized() or dist.get_world_size() <= 1:
        return flags
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" \
        else torch.device("cpu")
    n = torch.tensor([len(flags), -len(flags)], dtype=torch.int64, device=dev)
    dist.all_reduce(n, op=dist.ReduceOp.MIN)
    if int(n[0]) != -int(n[1]):  # another key list: gather reports the ranks' streams differ
        return flags
    if not flags:
        return flags
    t = torch.tensor([int(f) for f in flags], dtype=torch.int32, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return [bool(v) for v in t.tolist()]


def _merged(rec, parts: list, lanes: list, same: bool = False) -> list:
    """[(meta, tensor, lane)] for one key's piece records; same: the pieces are one value (on
    every rank: merge's _agree)."""
    # consumers last (after positions), whichever call noted them (a span row holds every call's)
    m0 = {k: v for k, v in parts[0][0].items() if k not in ("piece", "piece_const", "consumers")}
    if rec.piece_prefix and m0.get("piece_dim") is not None:
        # a decode run of the first positions: where the diff cuts what the reference did not
        # (ops, the float64 re-executions)
        m0["positions"] = [m0["piece_dim"], m0.get("piece_fold") or 1, *rec.piece_prefix]
    consumers = sorted({c for m, _ in parts for c in m.get("consumers", ())})
    if consumers:
        m0["consumers"] = consumers
    if parts[0][1] is None:  # hash capture: the slices' lanes add up to the whole's
        if parts[0][0].get("piece_const"):
            if same:
                return [(m0, None, lanes[0])]
            # pieces that differ: each piece's own (unmatched at the reference), as full capture
            return [(_own(m0, m), None, lane) for (m, _), lane in zip(parts, lanes)]
        shapes = [m.get("local_shape") for m, _ in parts]
        d = parts[0][0].get("piece_dim", 0)
        if d is not None and None not in shapes and not _joinable(shapes, d):
            # not slices of one whole (a sliding-window mask: _joinable): each piece's own
            return [(_own(m0, m), None, lane) for (m, _), lane in zip(parts, lanes)]
        # a piece's slot may itself be rows (a piece that is also a TP shard, batch > 1), or the
        # slots of many calls (add_span's row, a list)
        return [(m0, None, tuple(x for s in lanes for x in (s if isinstance(s, (tuple, list)) else (s,))))]
    from tpdiag.probes.stream import as_tensor

    ts = [as_tensor(t) for _, t in parts]
    whole = rec.piece_ref.get(m0["key"])
    d = parts[0][0].get("piece_dim", 0)
    rows = m0.get("piece_fold")
    whole_d = whole[d] if whole and d is not None and d < len(whole) else None
    if "positions" in m0 and whole_d in (rec.piece_whole, (rows or 1) * rec.piece_whole):
        whole_d = (rows or 1) * rec.piece_prefix[0]  # the first n positions of the reference's L
    if rows and all(m.get("piece_fold") == rows for m, _ in parts):
        # each sequence's rows of every call, in position order: [B, positions, ...] made flat
        t = torch.cat([x.unflatten(d, (rows, -1)) for x in ts], d + 1).flatten(d, d + 1)
    elif ts[0].ndim and d is not None and _joinable([x.shape for x in ts], d) and (
            whole_d == sum(x.shape[d] for x in ts) or (whole is None and not same)):
        t = torch.cat(ts, d)
    elif same:
        t = ts[0]  # the same per-call value in every piece
    else:
        # neither a slice of the whole nor shared: each piece's own (unmatched at the reference)
        return [({**_own(m0, m), "hash": _hash(x) if rec.hash else None}, x, None) for (m, _), x in zip(parts, ts)]
    m0["local_shape"] = list(t.shape)
    if rec.hash:
        # the hash of exactly this tensor: gather stores it as is and need not hash it again
        m0["hash"], m0["_hash_is_tensor"] = _hash(t), True
    return [(m0, t, None)]


def _joinable(shapes: list, d: int) -> bool:
    """Whether the pieces' shapes agree on every dim but d (their positions): a decode call's
    sliding-window attention mask is [B, 1, 1, window] where the prompt call's is [B, 1, P, P] -
    positions along dim 2 but another key length, not slices of the reference's [B, 1, L, L]."""
    s0 = list(shapes[0])
    return all(len(s) == len(s0) and list(s[:d]) == s0[:d] and list(s[d + 1:]) == s0[d + 1:] for s in shapes)


def _own(m0: dict, m: dict) -> dict:
    """m0 renamed as piece m's own record (unmatched at the reference)."""
    return {**m0, "name": f"{m0['name']}.piece{m['piece']}", "key": f"{m0['key']}.piece{m['piece']}"}


def _hash(t):
    """tensor_hash of a host tensor, on the world's GPU when it has one: the record-hash kernel
    gives the CPU path's bits (benchmarks record-hash), and a micro-batched region pass merges
    GBs (llama-1b 8 x 4096 on an H100: its mb=1 world took 47 s against the reference's 18 s)."""
    from tpdiag.records.hashing import tensor_hash

    if t.device.type == "cpu" and torch.cuda.is_available() and torch.cuda.is_initialized():
        return tensor_hash(t.to(torch.cuda.current_device()))
    return tensor_hash(t)


def _bits(t):
    return t.reshape(-1).view(torch.uint8) if t.is_contiguous() else t.contiguous().reshape(-1).view(torch.uint8)
