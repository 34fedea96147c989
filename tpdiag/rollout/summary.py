"""`tpdiag rollout`'s summary (rollout/run.py runs the configurations): the reference's numbers,
the closest configuration, the processed-logprobs verdict, the notes the checks found and the
what-to-do line, as one dict - `--format json`'s record and the text report's source."""
from __future__ import annotations

import time

from tpdiag.base.configs import any_static
from tpdiag.errors import BadInput


def _recipe_entry(rc) -> dict:
    """The trainer's logprob recipe every configuration ran (docs/rl.md, --logprob)."""
    from tpdiag.runner.recipe import Recipe

    r = rc.recipe or Recipe()
    return {**r.to_dict(), "formula": r.describe()}


def _not_judged(rc, results) -> str:
    """Why the processed-logprobs check did not run: it reads the logits rows of the first TP=1
    configuration that runs, in this process (a TP > 1 world sends back logprobs, not rows)."""
    if 1 not in rc.tp:
        why = "--tp has no 1"
    else:
        why = "no TP=1 configuration ran (" + "; ".join(
            f"{k}: {v['status']}" for k, v in results.items() if k.startswith("tp1-")) + ")"
    return (f"not judged: it reads the trainer's logits in a TP=1 configuration and {why}; "
            "add 1 to --tp to judge it (the worst tokens' margins and ranks come from it too)")


def dtype_note(rc) -> list[str]:
    """A bf16 checkpoint run without --dtype bfloat16 (the default is float32) is not reproduced,
    and the closest line can only say 'another dtype': name the two."""
    from tpdiag.models.dtypes import checkpoint_dtype

    got = checkpoint_dtype(rc.model, rc.dtype)
    return [got["note"]] if got and got["note"] else []


def summarise(rc, ro, seqs, vocab, cfgs, results, trainer, collector, stats_from, notes, t0,
             flag_values=None, pad_note=None, sampled=None, decodable: bool = True,
             cache_note=None, mode_bug=None, pad_bug=None, own=None) -> dict:
    from tpdiag.rollout import low_precision, metrics, processed, tp_gap, tp_invariance
    from tpdiag.runner.flags import one_line

    ok = [lab for lab in results if lab in trainer]
    if not ok:
        raise BadInput("no configuration could run for this model: "
                       + "; ".join(f"{k}: {v.get('reason')}" for k, v in results.items())
                       + (f" (--sampling ran generate()'s processors: {sampled['processors']})" if sampled else ""))
    reference = ok[0]
    ref_m = results[reference]["metrics"]
    # the engine reproduced: every token it gave a number for is the trainer's float32 bit for bit;
    # those configurations are the closest. Else the nearest - which explains nothing by itself
    reproduced = [lab for lab in ok if metrics.reproduces(seqs, results[lab]["metrics"])]
    ranked = sorted(ok, key=lambda lab: metrics.closeness(results[lab]["metrics"]))
    best = metrics.closeness(results[ranked[0]]["metrics"])
    closest = reproduced or [lab for lab in ranked if metrics.closeness(results[lab]["metrics"]) == best]
    verdict = processed.read_on(processed.judge(collector, vocab), stats_from, rc.modes) if stats_from else {
        "detected": None, "kind": None, "explanation": _not_judged(rc, results)}
    if reproduced and not sampled and verdict.get("detected"):
        # a configuration's raw log-softmax is every number the engine gave, bit for bit: whatever a
        # fit on another configuration's rows suggested, the engine's logprobs are raw
        verdict = {k: v for k, v in verdict.items() if not k.startswith("fit_")}
        t = (rc.recipe.temperature if rc.recipe is not None else 1.0)
        verdict.update(detected=False, kind=None, explanation=(
            f"{', '.join(reproduced)} give{'s' if len(reproduced) == 1 else ''} every engine logprob bit "
            + ("for bit from the trainer's raw logits, so the engine did not process them (a fit on "
               f"{stats_from}'s rows is rounding)" if t == 1.0 else
               f"for bit from the trainer's logits divided by its temperature {t:g} (--trainer-temperature): "
               "the engine's logprobs are at that temperature, with no filter")))
    if sampled:
        # the check read the processed rows: what it says is about what --sampling did not cover
        verdict["explanation"] = (f"with --sampling's processing ({sampled['processors']}) applied to the "
                                  f"trainer's logits: {verdict['explanation']}")
    from tpdiag.rollout import temperature_match

    temp = temperature_match.judge(rc.recipe, collector if stats_from else None, reproduced, sampled, verdict)
    # the engine's temperature is the trainer's: its temperature processing is the trainer's own division
    temp_ok = temp is not None and not temp["bug"]
    if temp:
        notes.append(temp["line"])
    if temp_ok and verdict.get("kind") == "temperature":  # the run gave that temperature already
        verdict["explanation"] = verdict["explanation"].replace(
            processed.flag_words(temp["engine"]), f"this run's trainer does (--trainer-temperature {temp['engine']:g})")
    if verdict.get("detected") and not (temp_ok and verdict.get("kind") == "temperature"):
        notes.append("the engine's logprobs look processed: the closest configuration says little "
                     "until the engine reports raw logprobs")
    engine_recipe = temp_ok and temperature_match.engine_form(rc.recipe, temp["engine"])
    if not reproduced and rc.recipe is not None and not rc.recipe.default and not engine_recipe:
        notes.append(f"every configuration took the trainer's logprob recipe ({rc.recipe.describe()}); an engine "
                     "reports log_softmax of its float32 logits (generate()'s output_logits, vLLM's sampler), at "
                     "its temperature where it processes them: where the recipe is not that, no configuration "
                     f"has the engine's bits even with the engine's logits - run {temperature_match.recipe_args(temp)} "
                     "to see whether the logits are the engine's")
    from tpdiag.rollout import shifted

    shift = None if reproduced or not stats_from else shifted.judge(collector.shift)
    if shift:
        notes.append(shift["line"])
    low = None if reproduced or not stats_from else low_precision.judge(seqs, collector.stats, rc.recipe)
    if low:
        notes.append(low["line"])
    pad_bug = None if reproduced else pad_bug
    if pad_bug:
        notes.append(pad_bug["line"])
    named = pad_bug if pad_bug and pad_bug.get("bug") else None  # the padding run wrong, not a rounding of it
    # a prompt that begins with pad tokens is the user's own where a configuration reproduces the engine
    pad_note = None if reproduced else pad_note
    if pad_note:
        notes.append(pad_note)
    # a trainer recipe other than the engine's log-softmax stops every configuration by itself (the
    # recipe note): the cache is no lead then
    recipe_own = rc.recipe is not None and not rc.recipe.default and not engine_recipe
    cache_note = cache_note if not reproduced and not recipe_own else None
    if cache_note:
        notes.append(cache_note)
    invariance = tp_invariance.find(cfgs, seqs, trainer)
    gaps = tp_gap.find(cfgs, seqs, trainer)
    notes += tp_gap.notes(gaps, rc.model, rc.dtype, invariance)
    if mode_bug and "line" in mode_bug:
        notes.append(mode_bug["line"].replace("--model MODEL", f"--model {rc.model}"))
    from tpdiag.rollout import batch_leak
    from tpdiag.rollout.todo import what_to_do

    if own:
        from tpdiag.rollout.own_loss import skipped_line

        notes.append(own["line"] if "line" in own else skipped_line(own))
    leak = batch_leak.find(cfgs, seqs, trainer)
    if leak:
        notes.append(leak["line"])
    todo = what_to_do(rc, cfgs, seqs, results, reference, reproduced, verdict, invariance, dtype_note(rc),
                      bool(pad_note), leak, decodable, bool(cache_note), recipe_own and not reproduced, bool(shift),
                      mode_bug if mode_bug and "line" in mode_bug else None, pad_bug, own,
                      gaps, low, temp)
    # a gap the file's own mistake makes (processing, a misaligned token, padding kept) is not noise
    noise = 0.0 if verdict.get("detected") or shift or pad_note or named or (temp and temp["bug"]) else ref_m["max_abs"]
    worst = metrics.worst_tokens(seqs, trainer[reference], collector.stats, rc.top, noise)
    return {
        "schema": 1, "command": "rollout", "file": rc.file, "format": ro.format, "model": rc.model,
        "dtype": rc.dtype, "device": rc.device, "seed": rc.seed,
        "sequences": len(seqs), "generated_tokens": sum(len(x.logprobs) for x in seqs),
        "reference": reference, "metrics": ref_m, "worst_tokens": worst,
        "margins_from": stats_from, "near_tie_nats": metrics.near_tie_nats(noise),
        "closest": {"configurations": closest, "reproduced": bool(reproduced),
                    "mean_abs": results[closest[0]]["metrics"]["mean_abs"],
                    "max_abs": results[closest[0]]["metrics"]["max_abs"],
                    "exact_tokens": results[closest[0]]["metrics"]["exact_tokens"],
                    "explanation": _closest_words(rc, results, closest, bool(reproduced))},
        "flags": {k: {"values": v, "line": one_line(v, k)} for k, v in (flag_values or {}).items()},
        "sdpa_ran": _sdpa_words(results),
        "what_to_do": todo,
        "logprob_recipe": _recipe_entry(rc),
        "processed": verdict, "shifted": shift, "left_padding": pad_bug, "mode_gap": mode_bug, "sampling": sampled, "configurations": results, "tp_invariance": invariance,
        "tp_gap": gaps, "low_precision": low,
        "batch_leak": leak, "own_loss": own, "temperature": temp,
        "notes": notes,
        "seconds": round(time.perf_counter() - t0, 3),
    }


def _closest_words(rc, results, closest: list, reproduced: bool) -> str:
    m = results[closest[0]]["metrics"]
    if reproduced:
        one = len(closest) == 1
        return (f"reproduced: {', '.join(closest)} give{'s' if one else ''} the engine's logprobs bit for "
                f"bit ({m['exact_tokens']}/{m['tokens']} tokens exact): the engine computed what "
                f"{'this configuration computes' if one else 'these configurations compute'}")
    tried = (f"tp {_vals(rc.tp)}, micro-batch {_vals(rc.micro_batch)}, mode {_vals(rc.modes)}, fix "
             f"{_vals(rc.fixes)}, flags {_vals(rc.flags)}, attention {_vals(rc.attention)}, padding "
             f"{_vals(rc.padding)}")
    # a configuration that failed gave no bits: "none tried gives them" would count it as tried and not
    # matching (red team hred11: a TP=2 world killed read as TP=2 tried)
    failed = [k for k, r in results.items() if isinstance(r, dict) and r.get("status") == "failed"]
    if failed:
        tried += (f"; {len(failed)} of them failed and are not compared ({', '.join(failed[:3])}"
                  f"{', ...' if len(failed) > 3 else ''}; why: above): the engine's may be among those")
    return (f"not reproduced: no configuration tried gives the engine's bits ({tried}). The nearest, "
            f"{closest[0]}, matches {m['exact_tokens']}/{m['tokens']} tokens (mean |diff| "
            f"{m['mean_abs']:.3g}, max {m['max_abs']:.3g}); it is nearest, not an explanation. Not "
            "matched: the engine computed with something none of these has - its own kernels "
            "(paged or flash attention, fused or CUDA-graph GEMMs, its sampler's logprobs), "
            "another dtype, other weights or model code, or flags outside the ones tried"
            + (" - or a static KV cache (generate(cache_implementation=\"static\"), TRL's "
               "cache_implementation: --padding auto,static tries it)"
               if "decode" in rc.modes and not any_static(rc.padding) else ""))


def _sdpa_words(results: dict) -> str:
    """Which SDPA backend ran (tpdiag.runner.sdpa_ran), in one line."""
    from tpdiag.runner.sdpa_ran import in_words

    return in_words({lab: r.get("sdpa_ran") or {} for lab, r in results.items() if r.get("status") == "ok"})


def _vals(xs) -> str:
    return ",".join(str(x) for x in xs)
