"""Where two degrees ran other algorithms in one phase: their op records line up by occurrence
count only as far as both ran the same ops (diff/engine.py leaves the rest uncompared)."""
from __future__ import annotations

from tpdiag.records.store import RecordSet


# Phases a degree may run as another algorithm (loss_parallel's vocab-parallel cross entropy, the
# invariant vocab softmax's groups, a sharded grad norm): their op records line up by occurrence
# count only as far as both degrees ran the same ops.
_ALGO_PHASES = ("loss", "optimizer")


def op_positions(rs: RecordSet) -> tuple[dict, dict]:
    """({group: [op, ...]} of the compute ops (collectives aside: a degree adds its own) each group
    - (step, phase, module, call) of a phase in _ALGO_PHASES or the unattributed backward - ran in
    order, {record key: (group, how many compute ops of its group ran up to it)})."""
    seq: dict = {}
    pos: dict = {}
    for m in rs.events:
        if m["kind"] != "op" or not (m["phase"] in _ALGO_PHASES or m["module"] == m["phase"] == "backward"):
            continue
        g = (m["step"], m["phase"], m["module"], m.get("call"))
        base, _, occ = str(m["name"]).rpartition("#")
        if occ.endswith(".0") and not base.startswith(("c10d::", "_c10d_functional::")):
            seq.setdefault(g, []).append(base)
        pos[m["key"]] = (g, len(seq.get(g, ())))
    return seq, pos


def other_algorithm(ref: RecordSet, other: RecordSet) -> set:
    """Keys of `other`'s op records past the ops both degrees ran alike in their group: up to
    there the n-th op of a kind is the same op at both (same ops, same order); past the first op
    that differs, the n-th add of one algorithm is not the n-th add of the other."""
    sa, _ = op_positions(ref)
    sb, pb = op_positions(other)
    common = {}
    for g, b in sb.items():
        a, n = sa.get(g, []), 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        # the optimizer's ops are per parameter, and a degree's parameters are other tensors (local
        # shards, the fixes' groups): its n-th norm is another parameter's norm once the streams
        # differ at all - nothing of the group lines up then
        common[g] = n if a == b or g[1] != "optimizer" else 0
    return {k for k, (g, i) in pb.items() if i > common.get(g, 0)}

