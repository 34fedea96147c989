"""Do the model's prefill and its decode compute the same function?

A trainer's prefill and an engine's decode through the KV cache are the same function of the
tokens in exact arithmetic; their stock bits differ by rounding only (other GEMM and attention
shapes). A mistake in the cached path - RoPE positions offset or restarting, a cache that keeps
the wrong keys - makes another function, and the engine's logprobs then move by what the mistake
moves them, which `rollout` reproduced bit for bit (through the user's own decode) and called a
rounding gap. The float64 run tells them apart without a yardstick from the run itself: the same
sequences, one per call, prefill and decode with the model cast to float64, where rounding is
~1e-16 relative and the float32 logprobs hold the float32 rounding of the logits (~1e-6 nats);
a gap past TOL is the model computing something else in one of its two paths.
"""
from __future__ import annotations

# nats between float64 prefill and decode: float32 logprobs of float64 logits round to ~2 ulp of
# the largest logit (4e-6 at logits of 30); the mistakes seen move them 1e-2 and more
TOL = 1e-3
# sequences read (each alone: no padding); the cost is one float64 prefill and decode of each
MAX_SEQS = 4
# parameters above which the float64 copy is not made (8 bytes each, beside the model)
MAX_PARAMS = 2_000_000_000


def check(ref, seqs, target, model) -> dict | None:
    """{'max_abs', 'mean_abs', 'tokens', 'line'} when float64 prefill and decode differ past TOL;
    {'skipped': reason} when it could not be run; None when they agree. `ref`: the trainer's
    configuration (its flags and attention are kept)."""
    import copy

    import torch

    from tpdiag.base.configs import Config
    from tpdiag.rollout.compute import Unavailable, logprobs

    if sum(p.numel() for p in model.parameters()) > MAX_PARAMS:
        return {"skipped": f"more than {MAX_PARAMS:.0e} parameters: no float64 copy made"}
    part = seqs[:MAX_SEQS]
    try:
        m64 = copy.deepcopy(model).double()
        got = {mode: logprobs(Config(1, 1, mode, "none", ref.flags, ref.attention, "auto"), target, m64, part)
               for mode in ("prefill", "decode")}
    except (Unavailable, RuntimeError, TypeError, ValueError, NotImplementedError) as e:
        return {"skipped": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}
    finally:
        m64 = None
    parts = []
    for s, a, b in zip(part, got["prefill"], got["decode"]):
        a, b = a[s.prompt_len - 1:].double(), b[s.prompt_len - 1:].double()
        both = torch.isfinite(a) & torch.isfinite(b)
        parts.append((a[both] - b[both]).abs())
    d = torch.cat(parts) if parts else torch.zeros(0)
    if not d.numel() or float(d.max()) <= TOL:
        return None
    most, mean = float(d.max()), float(d.mean())
    return {"max_abs": most, "mean_abs": mean, "tokens": int(d.numel()),
            "line": (f"prefill and decode are not the same function of the tokens: with the model in float64, "
                     f"{len(part)} sequence{'s' if len(part) != 1 else ''} one per call differ by up to {most:.3g} "
                     f"nats (mean {mean:.3g}) between one prefill call and decoding through the KV cache, where "
                     f"float64 rounds ~1e-15 (the check allows {TOL:g}) - a bug in the model's decode (or prefill) path, not "
                     "rounding: an engine that decodes with this code reports these numbers. `tpdiag compare "
                     "--model MODEL --tp 1 --mode prefill,decode --forward-only` names the module")}
