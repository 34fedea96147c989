"""`tpdiag rollout`'s `what to do:` line, as compare's (tpdiag.cli.render.what_to_do): from the
trainer's configuration (the reference: the first configuration that ran) to the engine.

Three cases. The trainer's configuration reproduces the engine: nothing to do. Another one does:
the settings that differ between the two, each with what it means for the user and how to match
it, and the trainer's gap in NeMo RL's terms (token_mult_prob_error against its 1.05). None does:
the engine computed something the trainer cannot in any configuration tried - what tpdiag found
that would explain it first (processed logprobs, the checkpoint's dtype, a TP path that is not
TP=1's), else what is left (another model, dtype or processing, or the engine's own kernels).
"""
from __future__ import annotations

from tpdiag.base.configs import STATIC_PADDINGS, Config, any_static
from tpdiag.rollout.batch_leak import FLOOR

# NeMo RL's threshold: a run whose token_mult_prob_error is above it is flagged (docs/rl.md)
NEMO_RL_THRESHOLD = 1.05
# an axis without words of its own (tests/test_rollout_what_to_do.py fails on one)
OTHER_AXIS = ("to match bitwise, run the trainer with the engine's value; or leave it: the gap is "
                 "rounding, harmless unless you need the engine's bits")


def what_to_do(rc, configurations: list, seqs, results: dict, reference: str, reproduced: list, processed: dict,
               invariance: dict, notes_dtype: list, padded: bool = False, leak: dict | None = None,
               decodable: bool = True, cache_off: bool = False, recipe_own: bool = False,
               shifted: bool = False, mode_bug: dict | None = None, pad_bug: dict | None = None,
               own: dict | None = None, tp_gaps: dict | None = None, low: dict | None = None,
               temp: dict | None = None) -> dict:
    """{case: nothing | settings | none, line, trainer, engine_like (the reproducing configuration
    nearest the trainer's, or None), differs ([{axis, trainer, engine, meaning}]),
    token_mult_prob_error (the trainer's), threshold}. own: rollout/own_loss.py's finding - a py:
    Target.loss that is not the tokens' log-softmax leads every case (case `loss` where tpdiag's
    log-softmax reproduces the engine and the user's loss does not)."""
    from tpdiag.rollout import own_loss

    own_bug = own if own and own.get("bug") else None
    cfgs = {c.rollout_name(): c for c in configurations}
    m = results[reference]["metrics"]
    out = {"trainer": reference, "engine_like": None, "differs": [],
           "token_mult_prob_error": m["token_mult_prob_error"], "threshold": NEMO_RL_THRESHOLD}
    tp_gaps = tp_gaps or {}
    tp_bugs = {lab: v for lab, v in tp_gaps.items() if v["bug"]}
    unjudged = sorted({v["tp"] for v in tp_gaps.values() if v["bug"] is None})
    # a TP degree whose logprobs are another function than TP=1's (rollout/tp_gap.py): whatever the
    # engine matches, training at that degree trains on wrong logprobs - said before anything else
    tp_first = ""
    if tp_bugs:
        worst = max(tp_bugs, key=lambda lab: tp_bugs[lab]["gap"])
        v = tp_bugs[worst]
        tp_first = (f"first: fix the trainer's TP={v['tp']} path - {worst} is {v['gap']:.3g} nats (mean) from "
                    f"{v['tp1']}, {_times(v)} (the TP note above): a bug in its TP plan or sharded code, not "
                    f"rounding; `tpdiag compare --model {rc.model} --tp 1,{v['tp']}` names the module; ")
        out["tp_bug"] = sorted(tp_bugs)
    if reference in reproduced and own_bug:
        return {**out, "case": "loss", "line": own_loss.lead(own_bug) + own_loss.reproduced_words(reference, m)
                + " " + own_loss.gap(own_bug)
                + (f"; then {tp_first[len('first: '):].rstrip('; ')}" if tp_first else "")}
    if reference in reproduced:
        return {**out, "case": "nothing",
                "line": tp_first + (f"{'at TP=1 ' if tp_first else ''}nothing to do: the trainer's configuration "
                                    f"({reference}) computes the engine's "
                         f"logprobs bit for bit ({m['exact_tokens']}/{m['tokens']} tokens exact, "
                         "token_mult_prob_error exactly 1)" + own_loss.rounding_words(own))
                + (f"; TP={', '.join(map(str, unjudged))} is further from TP=1 than {FLOOR:g} nats and not judged "
                   "(the TP note above)" if unjudged else "")}
    if reproduced:
        ref = cfgs[reference]
        # the reproducing configuration that changes the fewest of the trainer's settings
        like = min(reproduced, key=lambda lab: (len(cfgs[lab].differs(ref)), reproduced.index(lab)))
        differs = [{"axis": a, "trainer": getattr(ref, a), "engine": getattr(cfgs[like], a),
                    "meaning": _meaning(a, getattr(ref, a), getattr(cfgs[like], a), ref, cfgs[like], len(seqs))}
                   for a in cfgs[like].differs(ref)]
        for d in differs:
            if d["axis"] == "tp" and (like in tp_bugs or reference in tp_bugs):
                d["meaning"] = (f"the engine's numbers are TP={d['engine']}'s, your trainer's TP={d['trainer']}: in "
                                "this trainer the two degrees are not the same function (the TP note above) - a "
                                "bug in its TP path, not rounding; fix it before matching the kernels")
        if mode_bug:
            # the float64 check (rollout/mode_gap.py): the two modes are other functions, not other roundings
            for d in differs:
                if d["axis"] == "mode":
                    d["meaning"] = (f"your trainer scores in {d['trainer']}, the engine's numbers are {d['engine']}'s: "
                                    "in this model the two are not the same function (up to "
                                    f"{mode_bug['max_abs']:.3g} nats apart in float64: the prefill-and-decode note "
                                    "above) - a bug in its decode (or prefill) path, not rounding; fix it before "
                                    "matching the kernels")
        said = "; ".join(f"{d['axis'].replace('_', '-')} {d['trainer']} -> {d['engine']}: {d['meaning']}"
                         for d in differs)
        # the configuration the engine is, far from its own sequences alone (rollout/batch_leak.py):
        # its numbers are the model's batch bug, so no setting's gap to them is rounding
        lead = (f"first: the engine's numbers are not the model's for a batched sequence - {like} is "
                f"{leak['gap']:.3g} nats (mean) from {leak['alone']}, {_times(leak)} (the batch note "
                f"above): fix the model's {leak['mode']} path, or score and sample one sequence per call, "
                "before matching the settings below; "
                if leak and leak["configuration"] == like else
                "first: the engine's decode and the trainer's prefill are not the same function in this model "
                "(the prefill-and-decode note above): fix the model's decode (or prefill) path - `tpdiag compare "
                f"--model {rc.model} --tp 1 --mode prefill,decode --forward-only` names the module; "
                if mode_bug and "mode" in cfgs[like].differs(ref) else tp_first)
        gap = own_loss.gap(own_bug) if own_bug else _gap(m, ', from these settings alone')
        return {**out, "case": "settings", "engine_like": like, "differs": differs,
                "line": own_loss.lead(own_bug) + lead + (f"the engine's logprobs are {like}'s bit for bit, not the "
                         f"trainer's configuration ({reference}); they differ in {len(differs)} "
                         f"setting{'s' if len(differs) != 1 else ''}. {said}. {gap}" + own_loss.rounding_words(own))}
    first = [own_loss.lead(own_bug)[len("first: "):].rstrip("; ")] if own_bug else []
    from tpdiag.rollout.own_temperature import todo_words

    if todo_words(own):  # the user's loss is at the engine's temperature, the run at another
        first.append(todo_words(own)[len("first: "):].rstrip("; "))
    temp_bug = bool(temp and temp["bug"])
    if temp_bug:  # the two sides compute two distributions (rollout/temperature_match.py)
        first.append(f"make the engine's and the trainer's temperatures one (the temperature note above: the engine's "
                     f"logprobs are at {temp['engine']:g}, the trainer's at {temp['trainer']:g})")
    same = pad_bug is not None and pad_bug.get("bug") is False
    if same:  # the file is a padded batch whose positions start at the pad: rounding of the same function
        first.append("to match bitwise, pass position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0) with the "
                     "left-padded ids in whatever wrote the file (the left padding note above)")
    if pad_bug and pad_bug.get("bug"):  # the file is the model's on a wrongly run padded batch: the fix is in whatever wrote it
        first.append("pass the attention mask and position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0) "
                     "with the left-padded ids in whatever wrote the file (the left padding note above: "
                     + ("the pads were attended and the positions counted from the pad" if pad_bug["variant"] == "unmasked"
                        else "the positions were counted from the pad" if pad_bug["variant"] == "positions"
                        else "the pads were attended") + "), and run again")
    if shifted:  # the file's numbers belong to other tokens: no configuration can match them
        first.append("fix which token each logprob is taken for (the misaligned-logprobs note above) in "
                     "whatever wrote the file, and run again")
    if mode_bug:  # the model's own two paths disagree: no kernel setting closes that
        first.append("read the prefill-and-decode note above: this model's decode and prefill compute different "
                     "functions (`tpdiag compare --mode prefill,decode` names the module)")
    if padded:  # every token moves with it: before anything else
        first.append("write the sequences without the engine's left padding (the pad token note above) and "
                     "run again")
    if low:  # the file's numbers have 8 (11) significant bits: no float32 configuration gives them
        first.append(f"take the logprobs in float32 in whatever wrote the file (logits.float().log_softmax(-1)), or "
                     f"run again with --logprob model-dtype for a {low['dtype']} model's own {low['dtype']} "
                     f"log-softmax (the {low['dtype']} note above)")
    if recipe_own:  # the trainer's recipe is not the engine's log-softmax: no configuration can match
        from tpdiag.rollout.temperature_match import recipe_args

        first.append(f"run {recipe_args(temp)} to see whether the logits are the "
                     "engine's (the recipe note above; the recipe's own gap to the engine is then the rest)")
    if leak:
        first.append(f"read the batch note above ({leak['configuration']} is {leak['gap']:.3g} nats (mean) from "
                     f"{leak['alone']}, {_times(leak)}): the model's {leak['mode']} path lets a "
                     "call's other sequences into a sequence's logprobs")
    # a temperature the trainer divides by too is no processing to ask the engine to leave out
    temp_ok = temp is not None and not temp["bug"] and processed.get("kind") == "temperature"
    if processed.get("detected") and not temp_ok:  # found in the file itself: before what the model directory suggests
        first.append("ask the engine for raw logprobs (the processed line above; vLLM: "
                     "logprobs_mode=raw_logprobs; generate(): output_logits, not output_scores, or its "
                     "settings with --sampling to process the trainer's logits as generate() did) and run again - "
                     "processing alone moves every token")
    if cache_off:  # generate() without a KV cache: every generated token's call shape differs
        first.append("sample again with generate(..., use_cache=True) (the use_cache note above) and run "
                     "again with --mode decode")
    if notes_dtype:
        first.append("run again with the dtype the checkpoint is saved in (the checkpoint note above)")
    if tp_bugs:
        first.append(tp_first[len("first: "):].rstrip("; "))
    elif any(not v["same_bits"] for v in invariance.values()):
        first.append("read the TP note above: a TP degree under the fixes is not TP=1's bits (`tpdiag "
                     "compare` names the module)")
    untried = _untried(rc, len(seqs), decodable)
    if untried:
        first.append(f"try the settings engines differ on that were not tried: {untried}")
    head = ("nothing tried reproduces the engine: it computed something the trainer does not in any "
            "configuration here, so the nearest explains nothing and the gap is not shown to be rounding")
    rest = ("the engine computed with something outside the trainer's settings: another model or weights, "
            "another dtype, processing of its logprobs, or kernels of its own (paged or flash attention, "
            "fused or CUDA-graph GEMMs)")
    # a bug named above: no healthy run (a TP bug only where the trainer's configuration is that degree's)
    named = bool((pad_bug and pad_bug.get("bug")) or shifted or reference in tp_bugs or temp_bug)
    if pad_bug and pad_bug.get("bug"):
        head = ("nothing tried reproduces the file: its numbers are the model's on a left-padded batch run "
                "wrong (the left padding note above) - a bug in whatever wrote it, not rounding")
    elif low and low["rounding"] and not (shifted or padded or processed.get("detected")):
        head = (f"no configuration tried reproduces the file, but the {low['dtype']} note above explains it: its "
                f"logprobs are {low['dtype']} numbers within {low['dtype']}'s rounding of the trainer's - the gap is "
                "that rounding")
    elif same:
        head = ("no configuration tried reproduces the file, but the left padding note above does: its numbers are "
                "the model's on a left-padded batch with positions counted from the pad, for this model the same "
                "function as positions from the first real token (float64) - the gap is rounding")
    if first:
        body = "First " + "; then ".join(first) + f". If still none reproduces, {rest}"
    else:
        body = rest[0].upper() + rest[1:]
    gap = own_loss.gap(own_bug) if own_bug else _gap(m, '', bug=named)
    return {**out, "case": "none", "line": f"{head}. {body}. {gap}" + own_loss.rounding_words(own)}


def _gap(m: dict, cause: str, bug: bool = False) -> str:
    e = m["token_mult_prob_error"]
    over = e > NEMO_RL_THRESHOLD
    said = (f"The trainer as configured reads token_mult_prob_error {e:.7f} ({m['exact_tokens']}/{m['tokens']} "
            f"exact): ")
    if bug:
        # a named bug is no healthy run, however small its gap reads against the threshold
        return said + (f"{'over' if over else 'under'} NeMo RL's {NEMO_RL_THRESHOLD}, but the gap is the bug named "
                       "above, not rounding: the run is not healthy until it is fixed")
    return said + f"{'over' if over else 'within'} NeMo RL's {NEMO_RL_THRESHOLD} for a healthy run" + (cause if over else "")


def _meaning(axis: str, mine, theirs, ref: Config, like: Config, batch: int) -> str:
    """What one setting's difference means for the user, and how to match it."""
    if axis == "mode":
        if mine == "prefill":
            return ("your trainer scores each micro-batch in one prefill call; the engine decoded token by token "
                    "through its KV cache: other GEMM shapes (one row a step), so its kernels sum in another "
                    "order - rounding, harmless unless you need bitwise; to match bitwise, recompute through the "
                    "KV cache as the engine decodes (what --mode decode runs), or run batch-invariant kernels on "
                    "both sides (the fixes; docs/decode.md)")
        return ("the engine scored in one prefill call per micro-batch, as a trainer does, not token by token "
                "through a KV cache: other GEMM shapes - rounding; to match bitwise, score in one prefill call")
    if axis == "micro_batch":
        return (f"your trainer runs {mine} sequence{'s' if mine != 1 else ''} per forward call, the engine's "
                f"numbers are those of {theirs} per call{' (its whole batch)' if theirs == batch else ''}: GEMMs "
                "and reductions choose their split by the batch's shape (batch-variant kernels) - rounding; "
                f"to match bitwise, run {theirs} per call, or batch-invariant kernels on both sides (the fixes)")
    if axis == "tp":
        return (f"the engine's numbers are TP={theirs}'s, your trainer's TP={mine}: a TP degree sums partial "
                "results across ranks in another order - rounding; to match bitwise, run the trainer at "
                f"TP={theirs}, or TP-invariant kernels on both sides (the fixes; `tpdiag compare --fix auto`)")
    if axis == "fix":
        if theirs == "none":
            return (f"the engine ran stock kernels and the trainer the fixes ({mine}): they sum in other orders - "
                    "rounding; drop the fixes on the trainer's side to match")
        return (f"the engine's numbers are those under tpdiag's fixes ({theirs}), your trainer's "
                f"{'stock kernels' if mine == 'none' else mine}: the fixes change the order kernels sum in - "
                "rounding; run the trainer with the same fixes to match")
    if axis == "flags":
        return (f"the engine ran PyTorch's {theirs} backend flags, your trainer {mine} (deterministic "
                "algorithms, TF32, reduced-precision reductions: docs/rl.md's --flags table) - they pick other "
                "kernels, rounding; set the trainer's flags as the engine's to match")
    if axis == "attention":
        from tpdiag.runner.attention import IMPLEMENTATIONS

        backend = {"sdpa-math": "MATH", "sdpa-flash": "FLASH_ATTENTION", "sdpa-efficient": "EFFICIENT_ATTENTION",
                   "sdpa-cudnn": "CUDNN_ATTENTION"}.get(theirs)
        how = (f'attn_implementation="sdpa" under torch.nn.attention.sdpa_kernel(SDPBackend.{backend})' if backend
               else f'from_pretrained(..., attn_implementation="{IMPLEMENTATIONS.get(theirs, theirs)}")'
               if theirs != "auto"
               else "the model's own attention (from_pretrained's default)")
        return (f"the engine's attention is {theirs}, your trainer's {mine}: another attention kernel, which sums "
                f"in another order - rounding; to match bitwise, use {how} in the trainer")
    if axis == "padding" and "packed" in (mine, theirs):
        def did(p, c):
            return ("packed its sequences into one row (position ids restarting)" if p == "packed"
                    else f"padded on the {_side(p, c)}")
        how = ("pack as it does: the sequences end to end in one row, position_ids restarting at 0 for "
               "each, no attention_mask, use_cache=False" if theirs == "packed" else
               f"pad on the {_side(theirs, like)} as it does")
        return (f"the engine {did(theirs, like)}, your trainer {did(mine, ref)}: one row of every sequence "
                f"against a padded batch - other GEMM shapes, rounding; to match bitwise, {how}")
    if axis == "padding" and {mine, theirs} == set(STATIC_PADDINGS):
        return (f"the engine decoded through a static KV cache {'under' if theirs == 'compiled' else 'without'} "
                f"torch.compile, your trainer {'under' if mine == 'compiled' else 'without'} it: generate() compiles a "
                "static cache's decode steps on a GPU unless called with disable_compile=True, and inductor's kernels "
                "sum in other orders than the eager ones - rounding; to match bitwise, "
                + ("let it compile as generate() does" if theirs == "compiled" else "pass disable_compile=True as it did"))
    if axis == "padding" and {mine, theirs} & set(STATIC_PADDINGS):
        def did(p, c):
            if p in STATIC_PADDINGS:
                return ('through a static KV cache (generate(cache_implementation="static")'
                        + (", compiled)" if p == "compiled" else ")"))
            return ("through the default dynamic KV cache" if c.mode == "decode"
                    else f"with no KV cache (one prefill call, padded on the {_side(p, c)})")
        how = ('generate(cache_implementation="static"): the cache preallocated to the max length' if
               theirs in STATIC_PADDINGS else "without a static cache")
        return (f"the engine decoded {did(theirs, like)}, your trainer ran {did(mine, ref)}: every call "
                "through a static cache attends over all its preallocated positions (the unwritten ones masked), "
                "through a dynamic one over the positions seen so far - other attention shapes, rounding; to match bitwise, decode "
                f"as it does, {how}")
    if axis == "padding":
        return (f"the engine padded prompts on the {_side(theirs, like)}, your trainer on the {_side(mine, ref)}: "
                "each call's shape and the padding's place differ - rounding; pad as the engine does to match")
    return OTHER_AXIS


def _side(padding: str, c: Config) -> str:
    if padding in STATIC_PADDINGS:
        return "left, through a static KV cache"
    if padding == "auto":
        return "left (generate()'s)" if c.mode == "decode" else "right"
    return padding


def _untried(rc, batch: int, decodable: bool = True) -> str:
    out = []
    if 1 not in rc.tp:
        out.append(f"--tp {_vals(rc.tp)},1 (your degree stays the reference; TP=1 is what generate() and an "
                   "engine on one GPU run - else add the engine's own degree)")
    if "decode" not in rc.modes and decodable:
        out.append("--mode decode (token by token through the KV cache, as engines run)")
    # a micro-batch at least the batch runs the whole batch in one call, as the engine did
    if not any(m >= batch for m in rc.micro_batch):
        out.append(f"--micro-batch {batch} (the engine's batch, in one call)")
    if rc.attention == ("auto",):
        if str(rc.model).strip().startswith("hf:"):
            if _own_attention(str(rc.model).strip()[3:]) != "eager":
                out.append("--attention eager,sdpa")
            # else: auto ran eager already, and transformers has no SDPA for the model (Gemma2): the
            # two configurations would be auto's bits and `unavailable`
        else:  # eager is only hf: models' to switch, and sdpa is what auto runs here
            out.append("--attention auto,sdpa-math,sdpa-flash (the SDPA backend, where the model calls "
                       "F.scaled_dot_product_attention)")
    if "default" not in rc.flags:
        out.append("--flags default (PyTorch's, what engines run)")
    if not any_static(rc.padding) and decodable and str(rc.model).strip().startswith("hf:"):
        out.append("--padding auto,static" + (",compiled" if rc.device == "cuda" else "")
                   + " (decode through a static KV cache, as generate(cache_implementation=\"static\") and "
                   "TRL's cache_implementation=\"static\" run" + ("; compiled: generate()'s torch.compile'd "
                   "decode on a GPU, without disable_compile" if rc.device == "cuda" else "") + ")")
    elif "static" in rc.padding and "compiled" not in rc.padding and rc.device == "cuda" and decodable:
        out.append(f"--padding {_vals(rc.padding)},compiled (generate(cache_implementation=\"static\") without "
                   "disable_compile compiles its decode steps on a GPU)")
    return ", ".join(out)


def _own_attention(path: str) -> str | None:
    """The attention `--attention auto` ran for hf:DIR (eager where transformers has no SDPA path),
    or None where it cannot be read."""
    try:
        from tpdiag.models.hf import attention_of

        return attention_of(path)
    except Exception:  # noqa: BLE001 - a hint, never a failed report: propose both as before
        return None


def _vals(xs) -> str:
    return ",".join(str(x) for x in xs)


def _times(leak: dict) -> str:
    """How far past rounding a batch leak (rollout/batch_leak.py) or a TP gap (rollout/tp_gap.py) is:
    a ratio, or none to take where every other setting gave the same bits."""
    return f"{leak['ratio']:.0f}x rounding" if leak.get("ratio") else "where every other setting is bitwise"
