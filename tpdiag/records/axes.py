"""summary.json's per-configuration entries: `degrees` (the TP axis, as ever) and
`configurations` (every other axis: micro-batch, mode, grid), both with the same schema.
Readers go through `entries` so a configuration on any axis is judged, gated and reported."""
from __future__ import annotations


def entries(summary: dict) -> dict:
    """{label: entry} of every compared configuration: the very entry dicts of the summary, so
    an update through this view lands in summary.json."""
    out = {}
    for part in ("degrees", "configurations"):
        d = (summary or {}).get(part)
        if isinstance(d, dict):
            out.update({str(k): v for k, v in d.items()})
    return out


def axis_of_entry(label: str, entry) -> str:
    """The axis an entry differs from the reference in; entries written before the other axes
    existed are on the TP axis."""
    return (entry.get("axis") if isinstance(entry, dict) else None) or "tp"
