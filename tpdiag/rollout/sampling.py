"""`tpdiag rollout --sampling`: the engine's logprobs are generate()'s processed scores (its
`output_scores`, what the sampler drew from), so the trainer's logits go through the same
processors before the logprob.

The processors are transformers' own, built by the model's own `generate()` machinery
(`_prepare_generation_config`, then `_get_logits_processor`): the same classes, in the same order,
with the model's generation config merged in as generate() merges it - a setting the user did not
name takes generate()'s value (transformers 5.24 samples with top_k=50 unless told otherwise).
They run on float32 rows, one call per step over the micro-batch's rows, each row with the tokens
before it left-padded to the micro-batch's longest prompt with its attention mask: what generate()
hands them at that step when the micro-batch is its batch. Then the trainer's own logprob function
takes the processed rows: a float32 log-softmax, as `torch.log_softmax(scores, -1)` of
generate()'s scores. Prompt logprobs are not processed (an engine reports them raw).
"""
from __future__ import annotations

from tpdiag.errors import BadInput

# the settings generate() turns into logits processors that read one row and the tokens before it
SETTINGS = {"temperature": float, "top_k": int, "top_p": float, "min_p": float, "typical_p": float,
            "repetition_penalty": float, "no_repeat_ngram_size": int}


def parse(text: str) -> tuple[tuple[str, float | int], ...]:
    """'temperature=0.8,top_p=0.95' -> (('temperature', 0.8), ('top_p', 0.95)); '' or 'none' -> ()."""
    t = str(text or "").strip()
    if t.lower() in ("", "none", "raw"):
        return ()
    out: dict[str, float | int] = {}
    for item in t.split(","):
        key, eq, value = (p.strip() for p in item.partition("="))
        key = key.lower().replace("-", "_")
        if not eq or key not in SETTINGS:
            raise BadInput(f"--sampling {text!r}: {item.strip() or 'an empty item'!r} is not NAME=VALUE with NAME "
                           f"one of {', '.join(SETTINGS)} (generate()'s sampling settings)")
        if key in out:
            raise BadInput(f"--sampling {text!r}: {key} is given twice")
        try:
            v = SETTINGS[key](value)
        except ValueError:
            kind = "an integer" if SETTINGS[key] is int else "a number"
            raise BadInput(f"--sampling {text!r}: {key}={value!r} is not {kind}") from None
        out[key] = v
    return tuple(out.items())


def processors(model, sampling, prompt_ids, prompt_mask):
    """generate()'s LogitsProcessorList for a batch whose prompts are `prompt_ids` [n, P] (left
    padded, `prompt_mask` 0 on the padding), sampling on."""
    get = getattr(model, "_get_logits_processor", None)
    prep = getattr(model, "_prepare_generation_config", None)
    if get is None or prep is None:
        raise BadInput("--sampling applies transformers' generate() processors: it needs a transformers "
                       f"model (hf:DIR), not {type(model).__name__}")
    try:
        gc, _ = prep(None, do_sample=True, **dict(sampling))
        gc.validate()
        return get(generation_config=gc, input_ids_seq_length=prompt_ids.shape[1], encoder_input_ids=prompt_ids,
                   device=prompt_ids.device, model_kwargs={"attention_mask": prompt_mask})
    except ValueError as e:  # a processor checks its own value (a temperature <= 0)
        raise BadInput(f"--sampling: transformers refuses these settings: {str(e).splitlines()[0]}") from None


def describe(model, sampling) -> str:
    """The processors generate() runs for these settings, in its order: 'temperature 0.8, top_k 50,
    ...' (what the trainer's logits go through)."""
    import torch

    procs = processors(model, sampling, torch.ones(1, 1, dtype=torch.long), torch.ones(1, 1, dtype=torch.long))
    named = dict(sampling)
    words = []
    for p in procs:
        name = type(p).__name__.replace("LogitsProcessor", "").replace("LogitsWarper", "")
        key, value = _SETTING_OF.get(name, (None, None))
        value = getattr(p, value, None) if value else None
        if key is None:
            words.append(name)
        else:
            shown = f"{value:g}" if isinstance(value, (int, float)) else str(value)
            words.append(f"{key}={shown}" + ("" if key in named else
                                             " (not in --sampling: generate()'s default for this checkpoint)"))
    return ", ".join(words) if words else "none (these settings process nothing)"


# processor class (without its suffix) -> (the setting, the attribute holding its value)
_SETTING_OF = {"Temperature": ("temperature", "temperature"), "TopK": ("top_k", "top_k"),
               "TopP": ("top_p", "top_p"), "MinP": ("min_p", "min_p"), "Typical": ("typical_p", "mass"),
               "RepetitionPenalty": ("repetition_penalty", "penalty"),
               "NoRepeatNGram": ("no_repeat_ngram_size", "ngram_size")}


def apply(model, sampling, group, rows: list, ids, mask, plen: int) -> list:
    """`rows` (float32 [len - 1, vocab] per sequence of `group`, whole vocabulary) with each generated
    token's row processed as generate() processes it. ids/mask [n, >= plen + steps - 1]: the batch
    in generate()'s layout (tpdiag.rollout.compute.decode_inputs)."""
    import torch

    ids, mask = ids.to(rows[0].device), mask.to(rows[0].device)
    procs = processors(model, sampling, ids[:, :plen], mask[:, :plen])
    out = [r.clone() for r in rows]
    steps = max(s.n_generated for s in group)
    vocab = rows[0].shape[-1]
    for j in range(steps):
        live = [r for r, s in enumerate(group) if j < s.n_generated]
        # every row of the batch, as generate() calls them (a row that ended is zeros: row-wise
        # processors, so it changes no other row)
        x = torch.zeros(len(group), vocab, dtype=torch.float32, device=rows[0].device)
        for r in live:
            x[r] = rows[r][group[r].prompt_len - 1 + j]
        y = procs(ids[:, :plen + j], x)
        for r in live:
            out[r][group[r].prompt_len - 1 + j] = y[r]
    return out
