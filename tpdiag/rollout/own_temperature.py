"""A Target.loss whose logprobs are at another temperature than the run's: which one, and whether it
is the engine's.

own_loss judges -loss against the float64 log_softmax(logits / T) at the run's T
(--trainer-temperature, else 1). A loss that divides by the temperature the engine sampled at, run
without --trainer-temperature, is beyond that at nearly every token and read `BUG in Target.loss`
with `fix the loss` - though its logprobs were the engine's function and only the run's T was off
(tests/rl_user25.py's policy, generate() at T=0.7 reporting log_softmax(logits / 0.7): its own
token_mult_prob_error 1.005 against the engine, tpdiag's T=1 numbers 2.15). Every checked token's
-loss is held against log_softmax(logits / T') for each T' of the processed check's grid; the T'
nearest over the tokens, with every token within its rounding bound at T', is the loss's temperature.
Where the engine's numbers are at T' too (ten times nearer to it than to the run's T), the loss is
right and the run names the wrong T; else the loss's T' is named in its BUG line.
"""
from __future__ import annotations

import math

# the engine's numbers are at the loss's temperature: this many times nearer to it than to the run's
CLEAR = 10.0


def fit(toks: list, run_temp: float, bound_at) -> dict | None:
    """{'temperature' T', 'ratio' (the largest |own - float64 at T'| over its bound), 'engine'
    (whether the engine's numbers are at T')}; None where no T' other than the run's holds every
    token within rounding. toks: own_loss's checked tokens, each with its row '_z'; bound_at(z, own,
    ref, t): own_loss's rounding bound of -loss against the float64 logprob ref at temperature t."""
    import torch

    from tpdiag.rollout.processed import TEMPERATURES

    if not toks or any("_z" not in o for o in toks):
        return None
    grid = torch.tensor(TEMPERATURES, dtype=torch.float64)
    at = []  # per token: its float64 log_softmax(z / T')[token] for every T' of the grid
    for o in toks:
        z = o["_z"].double()
        at.append(torch.log_softmax(z[None] / grid[:, None].to(z.device), -1)[:, o["token"]].cpu())
    at = torch.stack(at)  # [tokens, grid]
    own = torch.tensor([o["own"] for o in toks], dtype=torch.float64)
    if not bool(torch.isfinite(own).all()):
        return None
    k = int((own[:, None] - at).abs().mean(0).argmin())
    t = TEMPERATURES[k]
    if t == run_temp:
        return None
    ratio = 0.0
    for o, ref in zip(toks, at[:, k].tolist()):
        b = bound_at(o["_z"], o["_own_t"], ref, t)
        ratio = max(ratio, abs(o["own"] - ref) / b)
        if not ratio <= 1:
            return None
    eng = torch.tensor([o["engine"] for o in toks], dtype=torch.float64)
    near = float((eng - at[:, k]).abs().mean())
    run = float((eng - torch.tensor([o["float64"] for o in toks], dtype=torch.float64)).abs().mean())
    return {"temperature": t, "ratio": ratio, "engine": math.isfinite(near) and near * CLEAR < run,
            "engine_mean_abs": near}


def words(r: dict, said: str, vs: str) -> str:
    """own_loss's line where the loss is the tokens' log-softmax at another temperature."""
    f, t = r["temperature_fit"], r["temperature"]
    head = (f"{said} is the tokens' log_softmax(logits / {f['temperature']:g}) within rounding at every token "
            f"(up to {f['ratio']:.2g} of its bound), not at this run's temperature {t:g}")
    if f["engine"]:
        return (f"{head}; the engine's logprobs are at {f['temperature']:g} too ({f['engine_mean_abs']:.2g} nats mean "
                f"from it): your loss computes the engine's function and the run named another temperature - run "
                f"again with --trainer-temperature {f['temperature']:g} (the configurations above take tpdiag's "
                f"log-softmax at {t:g}); {vs}")
    return head


def todo_words(own: dict) -> str:
    """The what-to-do line's first words where the loss is right at another temperature ('' else)."""
    f = (own or {}).get("temperature_fit")
    if not f or not f["engine"] or own.get("bug"):
        return ""
    return (f"first: run again with --trainer-temperature {f['temperature']:g} - your Target.loss takes its logprobs at "
            f"that temperature, as the engine reports them (the Target.loss note above); ")
