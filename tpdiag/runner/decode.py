"""Decode the way a rollout engine does: a prompt in one call, then one token per call through the
model's own KV cache - the logits every position gets, for comparing against prefill's.

    pieces = decode(model, ids, prompt_len)      # ids [B, L]
    logits = assemble(pieces)                    # [B, L, vocab]: row t as prefill's row t

Calls, in order: ids[:, :P] in one call (the prefill of the prompt), then ids[:, t:t+1] for
t = P .. L-1, one call each (a decode step: one query row per sequence attending to the t + 1
keys in the cache). Each call gives a `Piece`: the logits of positions [start, stop) along dim 1
of the batch - the same positions, so the same rows, that one prefill call over ids gives.
`on_call(start, stop)` runs before each call, so a recorder can file what the call produces as
the slice [start, stop) of dim 1 of the reference's records.

The prompt length is the caller's choice; DEFAULT: half the sequence (`default_prompt_len`), so
half the positions come from the prompt's prefill call (M = B * P rows per GEMM) and half from
single-token steps (M = B rows) - both kinds of call are covered whatever the sequence length.

Caches driven: transformers' DynamicCache for `hf:` models, or the model's own where generate()
gives it none (left padding through an attention mask and position ids, as generate() does), and any model with `new_kv_cache()` whose forward
takes `cache=` (the built-in presets: tpdiag.models.tiny_llama; a py: model may do the same).
Forward only, under torch.no_grad() by the caller or not: nothing here needs grads.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

PROMPT_FRACTION = 0.5
# one-token calls the unprobed run of a decode world makes after the prompt call: enough to run
# every kind of call the probed run makes (the prompt's M = B * P GEMMs, the M = B steps)
DECODE_SELFCHECK_CALLS = 16


class Unsupported(Exception):
    """The model has no KV cache tpdiag can drive, or not for this batch (the message says why)."""


@dataclass
class Piece:
    start: int   # first position (dim 1 of ids) whose logits this call gave
    stop: int    # one past the last
    logits: object  # [B, stop - start, vocab]: a Tensor, or a vocab-sharded DTensor at TP > 1


def default_prompt_len(seq_len: int) -> int:
    """Half the sequence (at least 1 position, at most seq_len): the prompt's prefill call."""
    return min(seq_len, max(1, int(seq_len * PROMPT_FRACTION)))


def is_hf(model) -> bool:
    import sys

    # a transformers model was built by transformers: not imported yet, none exists (importing it
    # here would cost seconds in every built-in model's decode world)
    if "transformers" not in sys.modules:
        return False
    from transformers import PreTrainedModel

    return isinstance(model, PreTrainedModel) and hasattr(model, "generate")


def supports(model) -> bool:
    """True when `decode` can drive the model's KV cache."""
    return is_hf(model) or callable(getattr(model, "new_kv_cache", None))


def why_not(model) -> str:
    return (f"{type(model).__name__} has no KV cache tpdiag can drive (decode needs an hf: model - "
            "transformers' cache - or a model with new_kv_cache() and forward(tokens, cache=...), "
            "as the built-in presets)")


def decode(model, ids, prompt_len: int, *, attention_mask=None, prompt_rows: str = "all",
           on_call: Callable[[int, int], None] | None = None, generate_args: bool = True,
           static_len: int | None = None, compiled: bool = False) -> list[Piece]:
    """The pieces of logits of ids [B, L]: the prompt ids[:, :prompt_len] in one call, then one
    position per call. prompt_rows 'all': the prompt call's piece covers positions 0..P-1;
    'last': only P-1 (the head on one row per sequence, generate()'s logits_to_keep=1 - an hf:
    model then computes only that row). attention_mask [B, L] (1 real, 0 padding: left padding
    of prompts of different lengths) is for hf: models; the built-in cache takes none.
    generate_args False (compare's decode world, no padding): an hf: model gets the tokens and the
    cache alone, as the trainer's prefill call gets the tokens alone - its modules then see the
    same inputs (transformers derives the positions from the cache), so their records line up.
    static_len: an hf: model's cache is transformers' StaticCache of that many positions (what
    generate(cache_implementation="static") preallocates: max_length - 1), not a DynamicCache.
    compiled (with static_len): the calls after the prompt go through the model's own
    get_compiled_call(generation_config.compile_config) - the torch.compile'd forward generate()
    runs a static cache's decode steps through on a GPU (its prefill stays eager, as there)."""
    if prompt_rows not in ("all", "last"):
        raise ValueError(f"prompt_rows {prompt_rows!r}: expected 'all' or 'last'")
    L = ids.shape[1]
    if not 1 <= prompt_len <= L:
        raise Unsupported(f"prompt length {prompt_len}: must be 1..{L} (the sequence length)")
    if not supports(model):
        raise Unsupported(why_not(model))
    if is_hf(model):
        if not generate_args:
            _no_padding(attention_mask, model)
        return list(_hf_steps(model, ids, prompt_len, attention_mask, prompt_rows == "last", on_call,
                              generate_args, static_len, compiled))
    if static_len is not None or compiled:
        raise Unsupported(f"a static KV cache is transformers' StaticCache (hf: models): {type(model).__name__} "
                          "has its own cache")
    return list(_cache_steps(model, ids, prompt_len, attention_mask, prompt_rows == "last", on_call))


def assemble(pieces: list[Piece]):
    """The pieces' logits along dim 1, [B, positions, vocab]; they must be contiguous."""
    import torch

    for a, b in zip(pieces, pieces[1:]):
        if a.stop != b.start:
            raise ValueError(f"pieces [{a.start}, {a.stop}) and [{b.start}, {b.stop}) are not contiguous")
    return torch.cat([p.logits for p in pieces], dim=1)


def prefill_logits(model, ids, attention_mask=None):
    """One cache-less call over ids (an hf: model with its mask and position ids): the trainer's
    rows, e.g. for an engine's prompt logprobs."""
    from tpdiag.runner.logits import logits_of

    if is_hf(model):
        mask, pos = _mask_and_positions(ids, attention_mask)
        return model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
    _no_padding(attention_mask, model, cache=False)
    return logits_of(model(ids))


def _cache_steps(model, ids, P, attention_mask, last_only, on_call):
    from tpdiag.runner.logits import logits_of

    _no_padding(attention_mask, model)
    cache = model.new_kv_cache()
    for start, stop in _calls(P, ids.shape[1]):
        if on_call is not None:
            on_call(start, stop)
        out = logits_of(model(ids[:, start:stop], cache=cache))
        if last_only and start == 0:
            yield Piece(stop - 1, stop, out[:, -1:])
        else:
            yield Piece(start, stop, out)


def _hf_steps(model, ids, P, attention_mask, last_only, on_call, generate_args=True, static_len=None,
              compiled=False):
    mask, pos = _mask_and_positions(ids, attention_mask)
    if static_len is not None and static_len < ids.shape[1]:
        raise Unsupported(f"a static KV cache of {static_len} positions cannot hold a micro-batch's "
                          f"{ids.shape[1]} (its longest prompt and most generated tokens, less one): "
                          "is --max-cache-len the engine's?")
    if generate_args and _generate_inputs(model):
        yield from _generate_steps(model, ids, P, mask, pos, last_only, on_call, static_len, compiled)
        return
    if compiled:
        raise Unsupported("a compiled decode follows generate()'s own loop (transformers 5.24's "
                          "prepare_inputs_for_generation), which this transformers does not have")
    cache = _new_cache(model, model.config, static_len)
    ck = _cache_kw(model)
    for start, stop in _calls(P, ids.shape[1]):
        if on_call is not None:
            on_call(start, stop)
        keep = {"logits_to_keep": 1 if last_only else 0} if start == 0 else {}
        where = {"attention_mask": mask[:, :stop], "position_ids": pos[:, start:stop]} if generate_args else {}
        o = model(input_ids=ids[:, start:stop], **where, **({ck: cache} if cache is not None else {}),
                  use_cache=True, **keep)
        cache = _returned_cache(o, ck, cache)
        n = o.logits.shape[1]
        yield Piece(stop - n, stop, o.logits)


def _new_cache(model, config, static_len=None):
    """The cache generate() starts with: a DynamicCache of the config, or None where transformers says
    the model builds its own (`_supports_default_dynamic_cache()` False: MiniMax's linear-attention
    MiniMaxCache, which refuses a DynamicCache) - the model's forward then makes it at the first call.
    static_len: generate(cache_implementation="static")'s StaticCache of that many positions - every
    call then attends over all of them (the unwritten ones masked): other attention shapes than the
    DynamicCache's, which holds only the positions seen so far."""
    from transformers import DynamicCache

    own = getattr(model, "_supports_default_dynamic_cache", None)
    if callable(own) and not own():
        if static_len is not None:  # generate() ignores cache_implementation for these (it warns)
            raise Unsupported(f"{type(model).__name__} builds its own cache: generate() ignores "
                              "cache_implementation=\"static\" for it (nothing static to reproduce)")
        return None
    if static_len is not None:
        from transformers import StaticCache

        return StaticCache(config=config, max_cache_len=static_len)
    return DynamicCache(config=config)


def _returned_cache(out, ck, cache):
    """The cache to hand the next call: the one the output carries (generate() takes it back from
    each output; a model that built its own returns it there), else the one passed in."""
    got = getattr(out, ck, None)
    if got is None and ck != "past_key_values":
        got = getattr(out, "past_key_values", None)
    return got if got is not None else cache


def _generate_inputs(model) -> bool:
    """True when this transformers' generate() loop asks the model for its inputs as `_generate_steps`
    does (`prepare_inputs_for_generation(..., next_sequence_length=...)`: 5.24; a model's override
    may take it through **kwargs, so the mixin's own signature is the one read)."""
    import inspect

    if not callable(getattr(model, "prepare_inputs_for_generation", None)):
        return False
    try:
        from transformers.generation.utils import GenerationMixin

        return "next_sequence_length" in inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
    except (ImportError, TypeError, ValueError):
        return False


def _generate_steps(model, ids, P, mask, pos, last_only, on_call, static_len=None, compiled=False):
    """generate()'s own loop (transformers 5 `_sample`), one position per call after the prompt: the
    cache generate() builds by default (a DynamicCache of the decoder's text config), each call's
    inputs made by the model's own `prepare_inputs_for_generation` - a model may override it, e.g.
    Phi-3 with longrope drops the cache and recomputes the whole prefix at the step that crosses
    original_max_position_embeddings, where the rope factors switch - the cache taken back from
    each output (it may be a new one), logits_to_keep=1 where the model takes it, the last row of
    each call's logits kept, and the steps after the prompt under the model's
    `_optimize_model_for_decode` (on a GPU, MoE experts switch from grouped_mm to batched_mm for
    decode)."""
    import inspect
    from contextlib import nullcontext

    tc = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    ck = _cache_kw(model)
    kw = {"use_cache": True}
    cache = _new_cache(model, tc, static_len)
    if cache is not None:  # generate() passes no cache to a model that makes its own
        kw[ck] = cache
    keeps = "logits_to_keep" in inspect.signature(model.forward).parameters
    if keeps:
        kw["logits_to_keep"] = 1 if last_only else 0
    if on_call is not None:
        on_call(0, P)
    inputs = model.prepare_inputs_for_generation(ids[:, :P], next_sequence_length=None, is_first_iteration=True,
                                                 attention_mask=mask[:, :P], position_ids=pos[:, :P], **kw)
    o = model(**inputs, return_dict=True)
    yield Piece(P - 1, P, o.logits[:, -1:]) if last_only else Piece(0, P, o.logits)
    if keeps:
        kw["logits_to_keep"] = 1
    # generate() compiles `self.__call__` once per model and compile config (get_compiled_call) and
    # runs every step after the prompt through it: inductor's kernels, not the eager ones, sum there
    step = model
    if compiled:
        # as the first generate() of a fresh engine process: dynamo's compile state is the process's
        # (a later call's graphs are recompiled with dynamic shapes - other kernels, other bits), so
        # each micro-batch starts from none, and the model's cached compiled call goes with it
        import torch._dynamo

        torch._dynamo.reset()
        model.__dict__.pop("_compiled_call", None)
        step = model.get_compiled_call(getattr(model.generation_config, "compile_config", None))
    optimized = getattr(model, "_optimize_model_for_decode", None)
    with optimized() if callable(optimized) else nullcontext():
        for start, stop in _calls(P, ids.shape[1]):
            if start == 0:
                continue
            cache = _returned_cache(o, ck, kw.get(ck))
            if cache is not None:
                kw[ck] = cache
            if on_call is not None:
                on_call(start, stop)
            inputs = model.prepare_inputs_for_generation(ids[:, :stop], next_sequence_length=1,
                                                         attention_mask=mask[:, :stop],
                                                         position_ids=pos[:, :stop], **kw)
            o = step(**inputs, return_dict=True)
            # under CUDA graphs (compile mode reduce-overhead) the next replay writes the same output
            # buffer: generate() copies the row out too
            yield Piece(start, stop, o.logits[:, -1:].clone() if compiled else o.logits[:, -1:])


def _calls(P: int, L: int):
    yield 0, P
    for t in range(P, L):
        yield t, t + 1


def _mask_and_positions(ids, attention_mask):
    """generate()'s: a mask of ones without padding; positions counted from each row's first
    real token (left padding)."""
    import torch

    mask = attention_mask if attention_mask is not None else torch.ones_like(ids)
    mask = mask.to(device=ids.device, dtype=torch.long)
    return mask, (mask.cumsum(-1) - 1).clamp(min=0)


def _no_padding(attention_mask, model, cache: bool = True) -> None:
    if attention_mask is not None and not bool(attention_mask.bool().all()):
        # named by whose it is: a py: model's cache is the user's own, not tpdiag's
        own = type(model).__module__.startswith("tpdiag.")
        if is_hf(model):
            what = "compare's decode call (the tokens and transformers' cache alone)"
        elif own:
            what = "the built-in KV cache" if cache else "the built-in model"
        else:
            what = (f"{type(model).__name__}'s KV cache (new_kv_cache(), forward(tokens, cache=...))" if cache
                    else f"{type(model).__name__}'s forward(tokens)")
        raise Unsupported(f"{what} takes no attention mask: left-padded prompts of different lengths in one "
                          "call need one (use micro-batch 1, or prompts of one length)")


def _cache_kw(model) -> str:
    """transformers 5.24 renamed forward's `past_key_values` to `cache` (the old name warns)."""
    import inspect

    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"
