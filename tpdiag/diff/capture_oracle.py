"""A capture's first divergence that nothing judged because the capture re-executed nothing.

`tpdiag compare` judges a first divergence no layout bound covers (a module's own forward code: a
norm over the wrong columns, attention, hand-written collectives) by re-executing that module in
float64 in a second pass. A capture cannot run the user's loop again: the float64 re-execution is
made while the reference capture records, for the modules `tpdiag.capture(..., oracle=...)` names.
Where the reference capture holds none for the first divergence's module, its cause stays
`unknown` - and a wrong result read as "not judged" (planted qk_norm_capture.py: a QK-norm over
each rank's local columns, `sharding-bug` under compare). That is incomplete evidence, not a
finding: the degree carries `unjudged_capture` (the module and the call that judges it), and the
gate exits 2 on it (gate/verdict.py) unless the policy allows `unknown` by name."""
from __future__ import annotations

from tpdiag.records.axes import entries


def _oracle_modules(ref) -> set[str]:
    return {m.get("module") for m in ref.events if m.get("kind") == "oracle"}


def mark_unjudged(summary: dict, ref, run_a: str) -> None:
    """Set entry['unjudged_capture'] = {module, why} on each divergent degree whose first divergence
    is `unknown` and whose module the reference capture `ref` (a RecordSet) never re-executed."""
    have = None
    for entry in entries(summary).values():
        fd = entry.get("first_divergence") or {}
        if entry.get("status") != "divergent" or fd.get("cause") != "unknown" or not fd.get("module"):
            continue
        have = _oracle_modules(ref) if have is None else have
        module = fd["module"]
        if module in have:
            continue  # re-executed and still unjudged (refused, a discrete choice): the reason says why
        entry["unjudged_capture"] = {
            "module": module,
            "why": (f"the reference capture made no float64 re-execution of {module}, so nothing tells a "
                    f"wrong result from rounding there: capture the reference ({run_a}) again with "
                    f"tpdiag.capture(..., oracle=[{module!r}]) and diff again (docs/capture.md)"),
        }
