"""The engine's temperature against the trainer's (`--trainer-temperature`).

An engine reports its logprobs at one temperature - raw (T=1: vLLM's default `raw_logprobs`,
generate()'s `output_logits`) or at the temperature it sampled at (`processed_logprobs`,
`output_logits / T`) - and the trainer's policy ratio divides by its own. The two temperatures are
read on the trainer's logits rows (rollout/processed.py: log_softmax(logits / T) for each T of a
grid): where the engine's numbers fit one T ten times better than the trainer's T, the two sides
compute two distributions, and no kernel or setting closes that gap - a bug in the RL pipeline
(the ratio mixes them), not rounding. Where they fit the trainer's own T, the temperature is
accounted for and what is left is the recipe's rounding (a bf16 division) or the kernels.
"""
from __future__ import annotations

# the engine's numbers fit one temperature this many times better than the trainer's
CLEAR = 10.0


def engine_temperature(collector) -> dict | None:
    """{'t', 'err', 'errs'}: the grid temperature nearest the engine's numbers (mean |error|, nats),
    with every grid temperature's error; None without temperature rows."""
    from tpdiag.rollout.processed import TEMPERATURES, temperature_errors

    errs = temperature_errors(list(collector.stats.values())) if collector is not None else None
    if errs is None:
        return None
    best = min(range(len(errs)), key=errs.__getitem__)
    return {"t": TEMPERATURES[best], "err": errs[best], "errs": errs}


def _error_at(fit: dict, t: float) -> float:
    from tpdiag.rollout.processed import TEMPERATURES

    near = min(range(len(TEMPERATURES)), key=lambda k: abs(TEMPERATURES[k] - t))
    return fit["errs"][near]


def engine_form(recipe, t: float) -> bool:
    """Whether the trainer's recipe is the engine's own at temperature t: a float32 log-softmax of
    the float32 logits divided by t, uncompiled."""
    return (recipe.name == "log-softmax" and recipe.temperature == t and not recipe.compiled
            and (t == 1.0 or recipe.divide_in == "float32"))


def judge(recipe, collector, reproduced: list, sampled, processed: dict) -> dict | None:
    """{'engine', 'trainer', 'engine_error', 'trainer_error', 'bug', 'line'}: the engine's temperature
    against the trainer's, where nothing reproduced the engine and the trainer names one (--sampling
    processes the trainer's rows itself, and a filter the engine renormalised after moves the
    temperature fit: not judged). bug: they differ."""
    if (reproduced or sampled or recipe is None or recipe.temperature == 1.0
            or processed.get("kind") not in (None, "temperature")):
        return None
    fit = engine_temperature(collector)
    if fit is None:
        return None
    t_r = recipe.temperature
    at_r = _error_at(fit, t_r)
    out = {"engine": fit["t"], "trainer": t_r, "engine_error": fit["err"], "trainer_error": at_r}
    mine = f"the trainer's (--trainer-temperature {t_r:g}) log_softmax(logits / {t_r:g})"
    if fit["t"] != t_r and fit["err"] * CLEAR < at_r:
        eng = ("raw (log_softmax(logits), temperature 1)" if fit["t"] == 1.0 else
               f"log_softmax(logits / {fit['t']:g})")
        theirs = ("the trainer must not divide its logits (without --trainer-temperature tpdiag computes the "
                  "engine's function)" if fit["t"] == 1.0 else
                  f"the trainer must divide by that (--trainer-temperature {fit['t']:g} computes the engine's function)")
        return {**out, "bug": True, "line": (
            f"temperature mismatch: the engine's logprobs are {eng} to {fit['err']:.2g} nats (mean), "
            f"{mine} is {at_r:.3g} nats from them - two distributions: a policy ratio of the two is off by "
            "that whatever the kernels, a bug in the RL pipeline, not rounding. If the engine sampled at "
            f"{t_r:g}, ask it for logprobs at that temperature (vLLM: logprobs_mode=processed_logprobs; "
            f"generate(): log_softmax(output_logits / {t_r:g})); if it sampled at {fit['t']:g}, {theirs}")}
    if fit["t"] == t_r and fit["err"] * CLEAR < _error_at(fit, 1.0):
        return {**out, "bug": False, "line": (
            f"the engine's logprobs are at the trainer's temperature, log_softmax(logits / {t_r:g}) to "
            f"{fit['err']:.2g} nats (mean): the temperature is accounted for, and what is left is "
            + ("the kernels" if engine_form(recipe, t_r) else "the recipe's rounding (the recipe note) or the kernels"))}
    return None


def recipe_args(match: dict | None) -> str:
    """How to run the engine's own recipe: at its temperature where the engine's is the trainer's."""
    if match and not match["bug"] and match["engine"] != 1.0:
        return f"with --trainer-temperature {match['engine']:g} alone (no --logprob/--temperature-in/--compiled)"
    return "without --logprob/--trainer-temperature/--compiled"
