"""The few whole tensors a report needs, read back from a run directory's records.

Only the first divergent record, the logprobs, the labels and the per-step scalars are
assembled: re-diffing every record would repeat `compare`'s work and hold the whole model.
"""
from __future__ import annotations

from tpdiag.errors import Inconclusive, NotComparable
from tpdiag.records.store import RecordSet


class _Subset:
    """A RecordSet restricted to some keys, so `diff_degree` assembles only those records."""

    def __init__(self, rs: RecordSet, keys: set[str]):
        self.world = rs.world
        self.events = [m for m in rs.events if m["key"] in keys]
        self.by_key = {m["key"]: m for m in self.events}
        self.tensor = rs.tensor
        # the stored-hash check (diff/pair_read.py) as the whole set does it
        self.hash_version, self.known_hashes, self.verify, self.vouch, self.checked_before = (
            rs.hash_version, rs.known_hashes, rs.verify, rs.vouch, rs.checked_before)


def _scalars(rs: RecordSet, kind: str) -> dict[int, float]:
    out = {}
    for m in rs.events:
        if m["kind"] == kind:
            t = rs.tensor(m)
            if t.numel():
                out[int(m["step"])] = float(t.flatten()[0].double())
    return out


def ulp_histogram(a, b) -> dict | None:
    """Element counts per power-of-two ULP bucket: bucket 0 holds equal elements, k >= 1 holds [2^(k-1), 2^k)."""
    import torch

    from tpdiag.diff import bits

    if not a.is_floating_point() or a.dtype not in bits.UNIT_ROUNDOFF:
        return None
    both = ~(torch.isnan(a) | torch.isnan(b))
    u = bits.ulp_distance(a, b)[both].to(torch.float64)
    bucket = torch.where(u > 0, torch.floor(torch.log2(u.clamp_min(1))) + 1, torch.zeros_like(u)).long()
    counts = torch.bincount(bucket.flatten(), minlength=1).tolist()
    return {"counts": counts, "numel": int(u.numel()), "nan_skipped": int((~both).sum())}


def _logprob_series(dd, lp_key: str | None, lab_key: str | None) -> dict | None:
    if lp_key is None or lp_key not in dd.tensors:
        return None
    import torch

    a, b = (t.to(torch.float64).flatten() for t in dd.tensors[lp_key])
    mask, seq = None, None
    lab = dd.tensors[lab_key][0] if lab_key in dd.tensors else None
    # labels as the step scored them (records/scored.py: shifted already, or shifted inside the
    # model as transformers does); sizes that do not line up: no mask
    from tpdiag.records.scored import scored_mask

    m = scored_mask(lab, a)
    if m is not None:
        mask = m.tolist()
        seq = (int(lab.shape[-1]) - (lab.numel() != a.numel())) if lab.dim() > 1 else None
    return {"diff": (b - a).tolist(), "mask": mask, "seq_len": seq}


def load(dirs: dict[str, str], reference: str, labels: list[str], first_keys: dict[str, str | None]) -> dict:
    """{label: {"ulp": ..., "logprobs": ..., "loss": {step: v}, "grad_norm": ..., "error": str|None}}.

    A degree whose records cannot be read gets an "error" and nothing else: the report still
    renders everything the summary and diff.csv hold.
    """
    from tpdiag.diff.engine import diff_degree

    out: dict[str, dict] = {}
    try:
        ref = RecordSet(dirs[reference])
        ref_steps = {"loss": _scalars(ref, "loss"), "grad_norm": _scalars(ref, "grad_norm")}
    except Inconclusive as e:
        return {lab: {"error": f"reference records: {e}"} for lab in [reference, *labels]}
    out[reference] = {**ref_steps, "error": None}
    for label in labels:
        entry: dict = {"error": None, "ulp": None, "logprobs": None}
        try:
            other = RecordSet(dirs[label])
            lp = next((m["key"] for m in other.events if m["kind"] == "logprobs" and m["step"] == 0), None)
            lab = next((m["key"] for m in other.events if m["kind"] == "batch" and m["name"] == "labels"), None)
            first = first_keys.get(label)
            keys = {k for k in (lp, lab, first) if k}
            dd = diff_degree(_Subset(ref, keys), _Subset(other, keys), label)
            if first in dd.tensors:
                entry["ulp"] = ulp_histogram(*dd.tensors[first])
            entry["logprobs"] = _logprob_series(dd, lp, lab)
            entry["loss"] = _scalars(other, "loss")
            entry["grad_norm"] = _scalars(other, "grad_norm")
        except (Inconclusive, NotComparable) as e:
            entry = {"error": str(e).splitlines()[0]}
        out[label] = entry
    return out
