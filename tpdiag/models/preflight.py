"""Memory preflight: before any world starts, which degrees can hold the model at this batch.

Per degree D, a lower bound of the busiest rank's peak (models/capacity.py's estimate of the
whole world - the larger of the loss's backward (parameters, activations kept for backward, logits,
the float32 cross-entropy's [tokens, vocab] tensors) and the optimizer step (parameters, grads,
AdamW's two moments) - divided by D: the ranks together hold at least the whole, so one holds at least 1/D of it). On
GPUs each rank has a device of its own: the bound is set against the free memory of GPU 0. On
the CPU every rank of a world shares the host: the whole world's bound is set against the
host's available memory, whatever the degree.

A world that does not fit is refused in one line before anything runs. When it is the
reference, the line proposes what does fit: `--layers N`, the first N decoder layers with the
real embedding and head (models/slice.py), and on GPUs the smallest degree that holds the
whole model as the reference (`--tp D,...`). The bound can only let through a run that then
runs out of memory, never refuse one that fits; what it proposes keeps the bound within
PROPOSE_SHARE of the memory, room for what the bound leaves out (the copy of the parameters
the self-check puts back for the probed run - runner/pristine.py -, records and hash buffers, float32 copies inside kernels, the allocator's slack).
"""
from __future__ import annotations

from tpdiag.errors import BadInput
from tpdiag.models.capacity import GiB, available_bytes, estimate_bytes, model_dims, sliced

_MAX_DEGREE = 64
PROPOSE_SHARE = 0.5


def need_bytes(dims: dict, degree: int, batch: int, seq: int, dtype: str, backward: bool, device: str,
               default_loss: bool = True) -> int:
    whole = estimate_bytes(dims, batch, seq, dtype, backward, default_loss)
    return -(-whole // degree) if device == "cuda" else whole


def largest_slice(dims: dict, spec, degree: int, have: int, batch, seq, dtype, backward, device,
                  default_loss: bool = True) -> int:
    """The most leading decoder layers whose world at `degree` fits in `have` bytes (0: none)."""
    total = dims.get("total_layers") or 0
    lo, hi = 0, total
    while lo < hi:  # the bound grows with the layers: bisect
        mid = (lo + hi + 1) // 2
        if need_bytes(sliced(dims, spec, mid), degree, batch, seq, dtype, backward, device, default_loss) <= have:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _valid_degrees(divisors: dict) -> list[int]:
    import math

    g = math.gcd(*divisors.values()) if divisors else _MAX_DEGREE
    return [d for d in (2, 4, 8, 16, 32, 64) if g % d == 0]


def preflight(spec, degrees, batch: int, seq: int, dtype: str, backward: bool, device: str,
              variant: str = "stock", gpus: int | None = None, have: tuple | None = None,
              default_loss: bool = True, micro_batch: int | None = None) -> dict:
    """{'device', 'available_bytes', 'where', 'per_rank' (GPU) or whole world (CPU), 'degrees':
    {D: {'need_bytes', 'fits'}}, 'layers', 'total_layers'} for the manifest; raises BadInput
    (one line) for a sequence past the model's positions or a world that cannot fit.
    have: (bytes, where) instead of asking the device (tests). default_loss: False where a fix takes the
    loss over (the float32 cross-entropy's [tokens, vocab] tensors are then not counted).
    A py: Target whose `inputs` draw its own batch is counted at that batch's rows x positions, not
    batch x seq (--batch-size x --seq-len, which it never runs): its smallest call's rows at most
    micro_batch (the smallest --micro-batch; a micro-batch past the batch runs it whole)."""
    from tpdiag.models.spec import model_divisors

    dims = model_dims(spec, variant)
    own = dims.get("inputs_shape")
    if own:
        batch, seq = (min(own[0], micro_batch) if micro_batch else own[0]), own[1]
    pos = dims.get("positions")
    if pos and seq > pos:
        raise BadInput(f"--seq-len {seq}: the model has {pos} positions; use --seq-len {pos} or less")
    avail, where = have if have is not None else available_bytes(device)
    out = {"device": device, "available_bytes": avail, "where": where,
           "per_rank": device == "cuda", "layers": dims.get("layers"), "total_layers": dims.get("total_layers"),
           "degrees": {}}
    for d in dict.fromkeys(degrees):
        need = need_bytes(dims, d, batch, seq, dtype, backward, device, default_loss)
        out["degrees"][str(d)] = {"need_bytes": need, "fits": None if avail is None else need <= avail}
    if avail is None:
        return out
    ref = degrees[0]
    loss = "the float32 cross-entropy's [tokens, vocab] tensors" if default_loss and dims.get("default_loss", True) \
        else "the logits' grad"
    at = f"at {batch} x {seq}{', the first ' + str(spec.layers) + ' decoder layers' if spec.layers else ''}"
    what = (f"({dtype} {at}: the larger of the loss's backward - parameters, activations, logits and {loss} - and "
            "the optimizer step - parameters, grads, AdamW's two moments)" if backward else
            f"({dtype} {at}: parameters, logits{' and the float32 cross-entropy over them' if 'float32' in loss else ''})")
    per = "per GPU" if device == "cuda" else "in all"
    ref_need = out["degrees"][str(ref)]["need_bytes"]
    if ref_need > avail:
        hints = []
        room = int(avail * PROPOSE_SHARE)
        n = largest_slice(dims, spec, ref, room, batch, seq, dtype, backward, device, default_loss) \
            if spec.kind in ("builtin", "hf") and dims.get("total_layers") else 0
        if n:
            from tpdiag.models.slice import describe

            hints.append(f"diagnose a slice: --layers {n} ({describe(n, dims.get('total_layers'))}) fits")
        if device == "cuda":
            bigger = [d for d in _valid_degrees(model_divisors(spec)) if d > ref and (gpus is None or d <= gpus)
                      and need_bytes(dims, d, batch, seq, dtype, backward, device, default_loss) <= room]
            if bigger:
                hints.append(f"or take TP={bigger[0]} as the reference (--tp {bigger[0]},...; it holds this "
                             f"model on {bigger[0]} GPUs)")
        smaller = "make Target.inputs' batch smaller" if own else "lower --batch-size or --seq-len"
        hints.append(smaller + (" (not even one decoder layer with the embedding "
                                "and head fits)" if not n and spec.kind != "py" else "")
                     if not hints else "or " + smaller)
        raise BadInput(f"--tp {ref}: the reference world needs at least {ref_need / GiB:,.1f} GiB {per} {what}, "
                       f"{avail / GiB:,.1f} GiB {where}; " + "; ".join(hints))
    for d in degrees[1:]:
        e = out["degrees"][str(d)]
        if not e["fits"]:
            raise BadInput(f"--tp {d}: the TP={d} world needs at least {e['need_bytes'] / GiB:,.1f} GiB {per} "
                           f"{what}, {avail / GiB:,.1f} GiB {where}; leave TP={d} out of --tp or use --layers")
    return out
