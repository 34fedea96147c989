"""summary.json not_judged in words: how many grads it lists and of which kind (activation or
weight grads), for the verdict, the gate's violation, the advice and the report."""
from __future__ import annotations

def _split(nj: dict) -> tuple:
    """(records, activation grads, weight grads) summary.json not_judged lists; the last two None where
    the split is unknown (fewer keys listed than records, no valid `weight_grads`). A summary without
    `weight_grads` counts the param_grad keys it lists."""
    from tpdiag.records.keys import MalformedKey, RecordKey

    n = nj.get("records")
    keys = [k for k in nj.get("keys") or () if isinstance(k, str)]
    n = n if isinstance(n, int) and not isinstance(n, bool) else len(keys)
    w = nj.get("weight_grads")
    if not isinstance(w, int) or isinstance(w, bool) or not 0 <= w <= n:
        if len(keys) < n:
            return n, None, None
        w = 0
        for k in keys:
            try:
                w += RecordKey.parse(k).kind == "param_grad"
            except MalformedKey:
                pass
    return n, n - w, w


def grads_words(nj: dict) -> str:
    """How many grads summary.json not_judged lists, and of which kind: '3 activation grads', '1 weight
    grad', '2 activation grads and 1 weight grad' (a weight's grad was called an activation grad);
    'N grads' where the split is unknown."""
    n, a, w = _split(nj)
    if a is None:
        return f"{n} grad{'s' if n != 1 else ''}"
    parts = [f"{a} activation grad{'s' if a != 1 else ''}" if a else "",
             f"{w} weight grad{'s' if w != 1 else ''}" if w else ""]
    return " and ".join(p for p in parts if p) or f"{n} grads"


def grads_kind(nj: dict) -> str:
    """The kind of the grads summary.json not_judged lists, no count: 'activation grads', 'weight grads',
    'activation and weight grads', 'grads' where it is unknown."""
    _, a, w = _split(nj)
    if not a and not w:
        return "grads"
    return "activation and weight grads" if a and w else "weight grads" if w else "activation grads"


def grad_words(key: str) -> str:
    """A listed record in words: 'weight grad of out_scale' for a param_grad record (the parameter's
    name in the model), else 'activation grad'; '' for a key that does not parse."""
    from tpdiag.records.keys import MalformedKey, RecordKey, param_name

    try:
        k = RecordKey.parse(key)
    except MalformedKey:
        return ""
    if k.kind == "param_grad" and k.name:
        return f"weight grad of {param_name(k.module, k.name)}"
    return "activation grad"
