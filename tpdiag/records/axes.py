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


# every axis a configuration's `config` may carry, in label order
AXIS_KEYS = ("tp", "micro_batch", "mode", "attention", "padding")


def not_run(summary: dict) -> list[dict]:
    """The combinations of the compared axes' values that no configuration ran. Axes compared one
    at a time (compare without --grid) never run, say, TP=2 in decode: a mistake that shows only
    there (a KV cache sized for the unsharded model) is in no configuration, so "rounding only"
    holds for what ran and says nothing about the rest."""
    import itertools

    ref = (summary or {}).get("reference_config")
    if not isinstance(ref, dict):
        return []
    keys = [k for k in AXIS_KEYS if k in ref]
    configs = [ref] + [e["config"] for e in entries(summary).values()
                       if isinstance(e, dict) and isinstance(e.get("config"), dict)]
    values = [list(dict.fromkeys(c.get(k, ref[k]) for c in configs)) for k in keys]
    if sum(len(v) > 1 for v in values) < 2:
        return []
    seen = {tuple(c.get(k, ref[k]) for k in keys) for c in configs}
    return [dict(zip(keys, combo)) for combo in itertools.product(*values) if combo not in seen]


def combination_name(config: dict, ref: dict) -> str:
    """'TP=2 decode', 'TP=2 mb=1': the degree, then each other axis where it is not the reference's."""
    words = [f"TP={config.get('tp')}"]
    for k in AXIS_KEYS[1:]:
        v = config.get(k)
        if v is None or v == ref.get(k):
            continue
        words.append({"micro_batch": f"mb={v}", "padding": f"pad={v}"}.get(k, str(v)))
    return " ".join(words)
