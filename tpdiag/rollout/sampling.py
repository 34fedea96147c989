"""`tpdiag rollout --sampling`: the engine's logprobs are generate()'s processed scores (its
`output_scores`, what the sampler drew from), so the trainer's logits go through the same
processors before the logprob.

The processors are transformers' own, built by the model's own `generate()` machinery
(`_prepare_generation_config`, `_prepare_special_tokens`, `_prepare_generated_length`, then
`_get_logits_processor`): the same classes, in the same order, with the model's generation config
merged in as generate() merges it - a setting the user did not name takes generate()'s value
(transformers 5.24 samples with top_k=50 unless told otherwise).
They run on float32 rows, one call per step over the micro-batch's rows, each row with the tokens
before it left-padded to the micro-batch's longest prompt with its attention mask: what generate()
hands them at that step when the micro-batch is its batch. Then the trainer's own logprob function
takes the processed rows: a float32 log-softmax, as `torch.log_softmax(scores, -1)` of
generate()'s scores. Prompt logprobs are not processed (an engine reports them raw).

Length-dependent processors: min_new_tokens counts from the prompt (any micro-batch gives
generate()'s steps); forced_eos_token_id forces EOS at generate()'s last step, max_length - 1, which
tpdiag knows only from max_new_tokens - without it that processor is refused, never guessed; so is
a checkpoint's own min_length (it counts generate()'s padded batch prompt).
"""
from __future__ import annotations

import json

from tpdiag.errors import BadInput


def _ints(v) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                    for t in v)


def _token_id(text: str):
    """An int, or a JSON list of ints (generate()'s eos_token_id may be several)."""
    v = json.loads(text)
    if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
        return v
    if _ints(v):
        return tuple(v)
    raise ValueError(text)


def _bad_words(text: str):
    """generate()'s bad_words_ids: a JSON list of token-id lists, [[5], [7, 8]]."""
    v = json.loads(text)
    if not (isinstance(v, list) and v and all(_ints(w) for w in v)):
        raise ValueError(text)
    return tuple(tuple(w) for w in v)


def _sequence_bias(text: str):
    """generate()'s sequence_bias as a GenerationConfig holds it: a JSON list of [token-id list, bias]."""
    v = json.loads(text)
    if not (isinstance(v, list) and v and all(isinstance(p, list) and len(p) == 2 and _ints(p[0])
                                              and isinstance(p[1], (int, float)) and not isinstance(p[1], bool)
                                              for p in v)):
        raise ValueError(text)
    return tuple((tuple(p[0]), float(p[1])) for p in v)


# the settings generate() turns into logits processors that read one row and the tokens before it
# (or that say which tokens those are: eos_token_id, max_new_tokens); NAME -> (parser, what a value is)
SETTINGS = {"temperature": (float, "a number"), "top_k": (int, "an integer"), "top_p": (float, "a number"),
            "min_p": (float, "a number"), "typical_p": (float, "a number"),
            "repetition_penalty": (float, "a number"), "no_repeat_ngram_size": (int, "an integer"),
            "min_new_tokens": (int, "an integer"), "eos_token_id": (_token_id, "a token id or a JSON list of them"),
            "max_new_tokens": (int, "an integer"), "forced_eos_token_id": (int, "an integer"),
            "bad_words_ids": (_bad_words, "a JSON list of token-id lists, e.g. [[5],[7,8]]"),
            "sequence_bias": (_sequence_bias, "a JSON list of [token-id list, bias], e.g. [[[5],-2.0]]")}


def _items(text: str) -> list[str]:
    """Split at the commas outside brackets (a JSON value holds its own)."""
    out, depth, cur = [], 0, []
    for ch in text:
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            out.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    out.append("".join(cur))
    return out


def parse(text: str) -> tuple[tuple[str, object], ...]:
    """'temperature=0.8,top_p=0.95' -> (('temperature', 0.8), ('top_p', 0.95)); '' or 'none' -> ().
    List values (bad_words_ids, sequence_bias, several eos ids) come back as tuples (hashable)."""
    t = str(text or "").strip()
    if t.lower() in ("", "none", "raw"):
        return ()
    out: dict[str, object] = {}
    for item in _items(t):
        key, eq, value = (p.strip() for p in item.partition("="))
        key = key.lower().replace("-", "_")
        if not eq or key not in SETTINGS:
            raise BadInput(f"--sampling {text!r}: {item.strip() or 'an empty item'!r} is not NAME=VALUE with NAME "
                           f"one of {', '.join(SETTINGS)} (generate()'s sampling settings)")
        if key in out:
            raise BadInput(f"--sampling {text!r}: {key} is given twice")
        conv, kind = SETTINGS[key]
        try:
            v = conv(value)
        except ValueError:
            raise BadInput(f"--sampling {text!r}: {key}={value!r} is not {kind}") from None
        out[key] = v
    if "forced_eos_token_id" in out and "max_new_tokens" not in out:
        raise BadInput(_FORCED_EOS.format(src="--sampling"))
    return tuple(out.items())


_FORCED_EOS = ("--sampling: forced_eos_token_id ({src}) makes generate() force EOS at its last step, which "
               "depends on the max_new_tokens it was given: add max_new_tokens=N (generate()'s) to --sampling; "
               "without it the forced step is not reproduced")


def _plain(v):
    """A parsed value as transformers takes it: lists, not tuples (through JSON they are lists already)."""
    return [_plain(x) for x in v] if isinstance(v, (tuple, list)) else v


def check(seqs, sampling) -> None:
    """Settings that contradict the rollout file: more tokens generated than max_new_tokens."""
    n = dict(sampling).get("max_new_tokens")
    if n is None:
        return
    over = next((s for s in seqs if s.n_generated > n), None)
    if over is not None:
        raise BadInput(f"--sampling max_new_tokens={n}: {over.where} has {over.n_generated} generated tokens; "
                       "give generate()'s own max_new_tokens")


def processors(model, sampling, prompt_ids, prompt_mask):
    """generate()'s LogitsProcessorList for a batch whose prompts are `prompt_ids` [n, P] (left
    padded, `prompt_mask` 0 on the padding), sampling on."""
    get = getattr(model, "_get_logits_processor", None)
    prep = getattr(model, "_prepare_generation_config", None)
    if get is None or prep is None:
        raise BadInput("--sampling applies transformers' generate() processors: it needs a transformers "
                       f"model (hf:DIR), not {type(model).__name__}")
    kw = {k: _plain(v) for k, v in sampling}
    try:
        gc, _ = prep(None, do_sample=True, **kw)
        gc.validate()
        if gc.forced_eos_token_id is not None and "max_new_tokens" not in kw:
            raise BadInput(_FORCED_EOS.format(src=f"{gc.forced_eos_token_id}, the checkpoint's generation_config"))
        if gc.min_length and "min_new_tokens" not in kw and getattr(gc, "eos_token_id", None) is not None:
            # generate()'s min_length counts its whole batch's padded prompt, which a rollout file does
            # not give (a micro-batch's own padding is another length): not reproduced, never guessed
            raise BadInput(f"--sampling: min_length={gc.min_length} (the checkpoint's generation_config) bans EOS "
                           "until the sequence, counted with generate()'s padded batch prompt, is that long; the "
                           "rollout file does not give that length: give min_new_tokens=N instead if generate() had one")
        # as generate() does before building them: the EOS tensor the min-length and bad-words
        # processors read (no EOS, no min-length processor: generate() adds none either), and
        # max_length / min_length from max_new_tokens / min_new_tokens and the prompt's length
        model._prepare_special_tokens(gc, True, device=prompt_ids.device, batch_size=prompt_ids.shape[0])
        gc = model._prepare_generated_length(gc, has_default_max_length="max_length" not in kw,
                                             has_default_min_length="min_length" not in kw,
                                             model_input_name="input_ids", input_ids_length=prompt_ids.shape[1],
                                             inputs_tensor=prompt_ids)
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
        if name == "MinLength" and "min_new_tokens" in named:
            continue  # generate()'s own min_length = min_new_tokens + the prompt: the same steps
        key, value = _SETTING_OF.get(name, (None, None))
        value = getattr(p, value, None) if value else None
        if hasattr(value, "tolist"):
            value = value.tolist()
        if key is None:
            words.append(name)
        else:
            shown = "" if value is None else "=" + (f"{value:g}" if isinstance(value, (int, float)) else
                                                     json.dumps(value, separators=(",", ":")))
            words.append(f"{key}{shown}" + ("" if key in named else
                                            " (not in --sampling: generate()'s default for this checkpoint)"))
    return ", ".join(words) if words else "none (these settings process nothing)"


# processor class (without its suffix) -> (the setting, the attribute holding its value)
_SETTING_OF = {"Temperature": ("temperature", "temperature"), "TopK": ("top_k", "top_k"),
               "TopP": ("top_p", "top_p"), "MinP": ("min_p", "min_p"), "Typical": ("typical_p", "mass"),
               "RepetitionPenalty": ("repetition_penalty", "penalty"),
               "NoRepeatNGram": ("no_repeat_ngram_size", "ngram_size"),
               "MinNewTokensLength": ("min_new_tokens", "min_new_tokens"), "MinLength": ("min_length", "min_length"),
               "NoBadWords": ("bad_words_ids", None), "SequenceBias": ("sequence_bias", None),
               "ForcedEOSToken": ("forced_eos_token_id", "eos_token_id")}


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
