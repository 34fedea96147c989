"""generate()'s max_new_tokens for `--padding static`: its StaticCache holds max_length - 1 = the
batch's longest prompt + max_new_tokens - 1 positions, and that length is every call's key length,
which changes SDPA's bits (docs/rl.md). A batch whose sequences all stopped at an EOS early ran
fewer steps, not a shorter cache, so a micro-batch's own most generated tokens is the length only
where one of them ran to max_new_tokens; every generate() call of a rollout is given the same
max_new_tokens, so one sequence anywhere in the file that ran out names it for all.

Where every sequence stopped at EOS and the user named nothing, generate() called without
max_new_tokens took the checkpoint's own: its generation_config.max_new_tokens (max_length = the
padded prompt + it), else its generation_config.max_length (the whole length: a cache of
max_length - 1 whatever the prompt) - read from the checkpoint, as from_pretrained reads it."""
from __future__ import annotations

from tpdiag.base.configs import any_static
from tpdiag.errors import BadInput


def resolve(rc, seqs) -> int:
    """max_new_tokens: --max-new-tokens, else --sampling's (the same generate() argument), else the
    rollout's most generated tokens (exact where any sequence ran to max_new_tokens). 0: no static
    configuration asks for it."""
    if rc.max_new_tokens < 0:
        raise BadInput(f"--max-new-tokens {rc.max_new_tokens}: must be >= 1 (0: from the rollout's sequences)")
    if not any_static(rc.padding) or "decode" not in rc.modes:
        if rc.max_new_tokens:
            raise BadInput(f"--max-new-tokens {rc.max_new_tokens}: it sets --padding static's KV cache length "
                           "(generate()'s max_length - 1); add static to --padding and decode to --mode "
                           "(e.g. --padding auto,static)")
        return 0
    most = max(s.n_generated for s in seqs)
    given, src = rc.max_new_tokens, "--max-new-tokens"
    if not given:
        given, src = int(dict(rc.sampling).get("max_new_tokens") or 0), "--sampling max_new_tokens"
    if given and given < most:
        over = next(s for s in seqs if s.n_generated == most)
        raise BadInput(f"{src}={given}: {over.where} has {most} generated tokens; give generate()'s own "
                       "max_new_tokens")
    if given:
        return given
    got = _from_checkpoint(rc, seqs)
    return got[1] if got and got[0] == "max_new_tokens" else most


def cache_len(rc, seqs) -> int:
    """--padding static's fixed cache length where the user names none (0: each micro-batch's own):
    the checkpoint's generation_config.max_length - 1 (generate()'s cache whatever the prompt, when
    called without max_new_tokens and the checkpoint sets no max_new_tokens), raised to its
    generation_config.max_cache_len - generate() sizes the cache max(max_length - 1, max_cache_len) -
    where that is at least every micro-batch's own length (then it is every micro-batch's length)."""
    if rc.max_cache_len or not any_static(rc.padding) or "decode" not in rc.modes:
        return rc.max_cache_len
    got = None
    if not (rc.max_new_tokens or dict(rc.sampling).get("max_new_tokens")):
        got = _from_checkpoint(rc, seqs)
    length = got[1] - 1 if got and got[0] == "max_length" else 0
    floor = _floor(rc, seqs)
    return max(floor, length) if floor else length


def _floor(rc, seqs) -> int:
    """The checkpoint's generation_config.max_cache_len where it is every micro-batch's cache: at
    least the file's longest prompt + max_new_tokens - 1 (a micro-batch asks for no more); else 0."""
    gc = _generation_config(rc.model)
    n = getattr(gc, "max_cache_len", None) if gc is not None else None
    if not isinstance(n, int) or n < 1:
        return 0
    need = max(s.prompt_len for s in seqs) + resolve(rc, seqs) - 1
    return n if n >= need else 0


def _from_checkpoint(rc, seqs):
    """('max_new_tokens', N) or ('max_length', N) of the checkpoint's generation config, where every
    sequence stopped at its EOS (none ran out: the file does not say the length) and the setting
    can have produced the file; None otherwise."""
    gc = _generation_config(rc.model)
    if gc is None:
        return None
    eos = _eos_of(gc, rc.sampling)
    if not eos or not all(s.n_generated and s.input_ids[-1] in eos for s in seqs):
        return None
    most = max(s.n_generated for s in seqs)
    n = getattr(gc, "max_new_tokens", None)
    if isinstance(n, int):  # it takes precedence over max_length (generate()'s _prepare_generated_length)
        return ("max_new_tokens", n) if n >= most else None
    n = getattr(gc, "max_length", None)
    if isinstance(n, int) and n >= max(s.prompt_len for s in seqs) + most:
        return ("max_length", n)
    return None


def _generation_config(spec_text: str):
    """The checkpoint's GenerationConfig as from_pretrained sets model.generation_config (its
    generation_config.json, else one from its config.json); None for a model that is no hf: DIR."""
    import os

    from tpdiag.models.spec import parse_spec

    spec = parse_spec(spec_text)
    if spec.kind != "hf":
        return None
    from transformers import AutoConfig, GenerationConfig

    if os.path.isfile(os.path.join(spec.value, "generation_config.json")):
        try:
            return GenerationConfig.from_pretrained(spec.value)
        except OSError:
            # from_pretrained loads the model all the same, on the config's own generation config
            # (its `except OSError`): a broken generation_config.json is not the rollout's error
            pass
    return GenerationConfig.from_model_config(AutoConfig.from_pretrained(spec.value))


def note(rc, seqs, model) -> list[str]:
    """Where every sequence ends at the model's EOS and the user named no max_new_tokens, the file
    does not say how long generate()'s static cache was: the length taken is the least it can be."""
    if not any_static(rc.padding) or "decode" not in rc.modes or rc.max_cache_len:
        return []
    floor = _floor(rc, seqs)
    if floor:
        return [f"padding static: the checkpoint's generation_config.max_cache_len {floor} sizes generate()'s static "
                "cache (the larger of it and max_length - 1, here it): taken as every micro-batch's cache length"]
    if rc.max_new_tokens or dict(rc.sampling).get("max_new_tokens"):
        return []
    eos = _eos(model, rc.sampling)
    if not eos or not all(s.n_generated and s.input_ids[-1] in eos for s in seqs):
        return []
    most = max(s.n_generated for s in seqs)
    got = _from_checkpoint(rc, seqs)
    if got:
        what = (f"max_new_tokens {got[1]} (the static cache: each micro-batch's longest prompt + {got[1]} - 1)"
                if got[0] == "max_new_tokens" else f"max_length {got[1]} (a static cache of {got[1] - 1} positions)")
        return [f"padding static: every sequence ends at an EOS ({sorted(eos)[:4]}), the longest after {most} "
                f"tokens, so the file does not say generate()'s max_new_tokens; taken as the checkpoint's "
                f"generation_config {what}, what generate() runs when called without max_new_tokens - pass "
                "--max-new-tokens N if the engine's call named its own"]
    return [f"padding static: every sequence ends at an EOS ({sorted(eos)[:4]}), the longest after {most} "
            "tokens, so the file does not say generate()'s max_new_tokens, which sets the static cache's "
            "length (the batch's longest prompt + max_new_tokens - 1) and with it the bits; taken as "
            f"{most}, the least it can be - pass --max-new-tokens N, generate()'s own, to reproduce a "
            "static engine given more (a generate() call without max_new_tokens, on a checkpoint whose "
            "generation config sets no length, ran 20: transformers' default max_length)"]


def _eos(model, sampling) -> set[int]:
    """The EOS ids generate() stops at: --sampling's eos_token_id, else the generation config's."""
    return _eos_of(getattr(model, "generation_config", None), sampling)


def _eos_of(gc, sampling) -> set[int]:
    v = dict(sampling).get("eos_token_id")
    if v is None:
        v = getattr(gc, "eos_token_id", None) if gc is not None else None
    if v is None:
        return set()
    return {int(x) for x in (v if isinstance(v, (list, tuple)) else [v])}
