"""The reference world's float64 re-executions (oracle records, probes/oracle_hooks.py) read into a
DegreeDiff: the reference's and this side's own-input values by the record each judges, the grads an
input received and a descendant's output grad in its ancestor's backward, the norms a world kept in
their place, and which re-execution wrote each buffer's value (diff/engine.diff_degree calls load)."""
from __future__ import annotations


def load(dd, ref, oracle_metas: list, label: str) -> None:
    """Fill dd's oracle tables from the reference's oracle records `oracle_metas`; label: this side's
    (an own-input re-execution names the world whose inputs it ran from)."""
    from tpdiag.diff.oracle import target_key
    from tpdiag.records.keys import ORACLE_NORMS as NORMS, ORACLE_TAP as TAP, RecordKey, root_of

    # the root's record name in these records ("(root)" above HF's `model` child)
    enclosing_root = root_of({r["module"] for r in dd.rows})
    wanted = {r["key"] for r in dd.rows if not r["bitwise"]}
    writer_depth: dict = {}  # (own side, buffer key) -> its oracle's path depth under the writer
    for m in oracle_metas:
        name, at, side = m["name"].partition("@")
        if at and side != label:
            continue  # re-executed from another world's inputs
        if name.endswith(NORMS):
            full = m["key"][:len(m["key"]) - len(side) - 1] if at else m["key"]
            k = target_key(full[:len(full) - len(NORMS)])
            if k in wanted:
                (dd.oracle_own_norms if at else dd.oracle_norms)[k] = ref.tensor(m)
            continue
        oracle, grad_in = (dd.oracle_own, dd.grad_in_own) if at else (dd.oracle, dd.grad_in)
        if name.startswith(TAP):
            # a descendant's output grad in an ancestor's float64 backward: grad_out.O.cJ.pP.uK,
            # the ancestor K name levels up (the root past the top); no .uK (a run before): the
            # nearest called ancestor's (diff/enclosing.tapper)
            o, j, pc, *up = name[len(TAP):].split(".")
            by = None
            if up and up[0][1:].isdigit():
                parts = m["module"].split(".")
                k_up = int(up[0][1:])
                by = ".".join(parts[:len(parts) - k_up]) if k_up < len(parts) else enclosing_root
            (dd.grad_at_own if at else dd.grad_at)[(m["step"], m["module"], int(j[1:]), o, int(pc[1:]), by)] = \
                ref.tensor(m)
            continue
        if name.startswith("grad_in."):
            # d loss / d input I of a consumer: judged against its producer's grad_out
            i, _, c = name[len("grad_in."):].partition(".c")
            k = (m["step"], m["module"], int(i))
            grad_in.setdefault(k, []).append(ref.tensor(m))
            continue
        k = target_key(m["key"][:len(m["key"]) - len(side) - 1] if at else m["key"])
        if k not in wanted:
            continue
        if name.startswith("buffer."):
            # a written buffer holds what its owner's last call left: an ancestor's float64 run
            # (recorded after its child's) computed the owner's inputs in float64 too, no exact
            # value of what the owner read (an FP8 cast above it: a SUM-reduced amax read
            # 'rounding only'); the nearest writer, its last call, judges
            near = _depth(RecordKey.parse(k).module, enclosing_root) - _depth(m["module"], enclosing_root)
            if k in oracle and near > writer_depth.get((at, k), near):
                continue
            writer_depth[(at, k)] = near
            oracle[k] = ref.tensor(m)
            if not at:
                dd.oracle_writer[k] = (int(m["step"]), m["module"])
            continue
        t = ref.tensor(m)
        # a weight grad's calls add up
        oracle[k] = oracle[k] + t if k in oracle else t


def _depth(module: str, root: str) -> int:
    """A record name's depth in the model: 0 for the root (its record name `root`), 1 for its children."""
    return 0 if module == root else module.count(".") + 1
