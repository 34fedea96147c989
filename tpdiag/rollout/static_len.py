"""generate()'s max_new_tokens for `--padding static`: its StaticCache holds max_length - 1 = the
batch's longest prompt + max_new_tokens - 1 positions, and that length is every call's key length,
which changes SDPA's bits (docs/rl.md). A batch whose sequences all stopped at an EOS early ran
fewer steps, not a shorter cache, so a micro-batch's own most generated tokens is the length only
where one of them ran to max_new_tokens; every generate() call of a rollout is given the same
max_new_tokens, so one sequence anywhere in the file that ran out names it for all."""
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
    return given or most


def note(rc, seqs, model) -> list[str]:
    """Where every sequence ends at the model's EOS and the user named no max_new_tokens, the file
    does not say how long generate()'s static cache was: the length taken is the least it can be."""
    if not any_static(rc.padding) or "decode" not in rc.modes or rc.max_cache_len or rc.max_new_tokens \
            or dict(rc.sampling).get("max_new_tokens"):
        return []
    eos = _eos(model, rc.sampling)
    if not eos or not all(s.n_generated and s.input_ids[-1] in eos for s in seqs):
        return []
    most = max(s.n_generated for s in seqs)
    return [f"padding static: every sequence ends at an EOS ({sorted(eos)[:4]}), the longest after {most} "
            "tokens, so the file does not say generate()'s max_new_tokens, which sets the static cache's "
            "length (the batch's longest prompt + max_new_tokens - 1) and with it the bits; taken as "
            f"{most}, the least it can be - pass --max-new-tokens N, generate()'s own, to reproduce a "
            "static engine given more"]


def _eos(model, sampling) -> set[int]:
    """The EOS ids generate() stops at: --sampling's eos_token_id, else the generation config's."""
    v = dict(sampling).get("eos_token_id")
    if v is None:
        gc = getattr(model, "generation_config", None)
        v = getattr(gc, "eos_token_id", None) if gc is not None else None
    if v is None:
        return set()
    return {int(x) for x in (v if isinstance(v, (list, tuple)) else [v])}
