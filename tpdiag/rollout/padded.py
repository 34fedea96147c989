"""A rollout file that kept the engine's left padding in `input_ids`.

generate()'s `sequences` (and an engine's batch tensors) are left-padded to the longest prompt; a
user who writes those rows as `input_ids` hands tpdiag the pad tokens as prompt. tpdiag then runs
them as real tokens - attended, at other positions - so no configuration can reproduce the engine,
and the gap (token_mult_prob_error over NeMo RL's 1.05 in a new user's trial) read as the engine's
own kernels. A sequence whose prompt begins with the model's pad token is named, with what to write.
"""
from __future__ import annotations


def _token(v) -> int | None:
    if isinstance(v, (list, tuple)):
        v = v[0] if v else None
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def model_pad(model) -> tuple[int | None, int | None]:
    """(pad id, bos id) of a model whose config names them (hf:), else (None, None): the built-in
    presets and a py: model without a config have no pad token a file could hold."""
    from tpdiag.rollout.compute import pad_id

    cfgs = [getattr(model, "generation_config", None), getattr(model, "config", None)]
    if not any(_token(getattr(c, k, None)) is not None for c in cfgs if c is not None
               for k in ("pad_token_id", "eos_token_id")):
        return None, None
    bos = next((b for b in (_token(getattr(c, "bos_token_id", None)) for c in cfgs if c is not None)
                if b is not None), None)
    return pad_id(model), bos


def leading_pads(seqs, pad: int, bos: int | None) -> list[tuple[str, int]]:
    """[(where, n)] for each sequence whose prompt begins with n pad tokens. Where the pad token is
    also the BOS, the first one may be the prompt's own BOS: only the ones after it count."""
    out = []
    for s in seqs:
        n = 0
        while n < s.prompt_len and s.input_ids[n] == pad:
            n += 1
        if pad == bos:
            n = max(0, n - 1)
        if n:
            out.append((s.where, n))
    return out


def note(seqs, model) -> str | None:
    """The note naming the sequences that look left-padded, or None."""
    pad, bos = model_pad(model)
    if pad is None:
        return None
    found = leading_pads(seqs, pad, bos)
    if not found:
        return None
    where = ", ".join(f"{w}: {n}" for w, n in found[:5]) + (f", and {len(found) - 5} more" if len(found) > 5 else "")
    return (f"{len(found)} of {len(seqs)} sequences begin with the model's pad token (id {pad}; {where}): if "
            "that is the engine's left padding (generate()'s `sequences` rows are padded to the longest prompt), "
            "the file holds it as prompt and the trainer runs it as real tokens, so no configuration can "
            "reproduce the engine - write each sequence's own tokens only (input_ids without the padding, "
            "prompt_len without it); tpdiag pads as the engine does (--mode decode: left, with an attention mask)")
