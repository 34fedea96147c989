"""The trainer's logprobs for the engine's tokens, in one configuration, in this process (TP=1).

A configuration (tpdiag.base.configs.Config, compare's type too) is (tp, micro_batch, mode, fix,
flags, attention, padding) - the last three are the axes engines and trainers differ on besides
the shapes: the backend flags (PyTorch's defaults or the deterministic settings:
tpdiag.runner.flags), the attention implementation (the model's own, eager, SDPA, or SDPA
restricted to one backend: tpdiag.runner.attention) and
which side prompts are padded on. Prefill runs each micro-batch of sequences as
one call, right-padded (causal attention: a real position never sees the padding, but the call's
shape - which batch-variant kernels read - is the micro-batch's). Decode runs the way a rollout
engine (and transformers' `generate()`) does: the prompts in one prefill call, left-padded with an
attention mask, then the generated tokens one step at a time through the model's KV cache
(tpdiag.runner.decode: transformers' cache for hf: models, the built-in presets' own).
Logprobs are taken with the trainer's own function (tpdiag.runner.losses), and with the fixes'
invariant vocab softmax under --fix.
"""
from __future__ import annotations

from contextlib import ExitStack

# the one configuration type (compare's worlds are the same type), importable from here as before
from tpdiag.base.configs import MODES, PADDINGS, STATIC_PADDINGS, Config  # noqa: F401
from tpdiag.errors import BadInput

# where generate() compiles a static cache's forward (transformers' _valid_auto_compile_criteria)
COMPILING_DEVICES = ("cuda", "xpu")

PAD = 0  # models without a pad token of their own (the built-in presets)


class Unavailable(Exception):
    """This configuration cannot run for this model (the reason is the message)."""


def build(spec_text: str, dtype: str, device: str, seed: int):
    """(target, model) whole on `device` in `dtype` as the user loads it (tpdiag.models.dtypes),
    in eval mode - what TP=1 trains with."""
    import torch

    from tpdiag.models.build import build_target
    from tpdiag.models.spec import parse_spec

    spec = parse_spec(spec_text)
    torch.manual_seed(seed)
    # this process's model runs TP=1 only (TP > 1 worlds build their own, and check_plan refuses a
    # model no plan splits first): an hf: model without a TP plan is still the user's model here
    target = build_target(spec, "stock", torch.device(device), seed, need_plan=False)
    from tpdiag.models.dtypes import to_run_dtype

    model = to_run_dtype(spec.kind, target.model.to(device=torch.device(device)), getattr(torch, dtype))
    model.eval()
    return target, model


def logprobs(cfg: Config, target, model, seqs, on_logits=None, world: int = 1, tree_groups: int = 0,
             on_flags=None, sampling=(), max_cache_len: int = 0, max_new_tokens: int = 0, recipe=None,
             on_rows=None) -> list:
    """Per sequence a float32 tensor [len - 1]: the trainer's logprob of input_ids[t] at t-1.
    on_logits(i, rows): the logits rows [len - 1, vocab] of sequence i (in decode, the prompt's
    rows are NaN unless the engine gave prompt logprobs). on_flags(setting, snapshot): the backend
    flags this configuration ran under (tpdiag.runner.flags.snapshot). sampling: generate()'s
    settings whose processors the generated tokens' rows go through first (tpdiag.rollout.sampling).
    max_cache_len: padding static's cache length (0: generate()'s for the micro-batch, _decode);
    max_new_tokens: generate()'s, which sets that length (0: the micro-batch's most generated tokens).
    recipe: the trainer's logprob recipe (tpdiag.runner.recipe.Recipe; None: the default).
    on_rows(i, rows): sequence i's logits rows exactly as the model returned them, under this
    configuration's flags and fixes (a py: Target's own loss reads them: rollout/own_loss.py)."""
    import torch

    from tpdiag.fixes.registry import apply_fixes, resolve
    from tpdiag.kernels.tree import install_tree_groups
    from tpdiag.runner.attention import attention
    from tpdiag.runner import flags
    from tpdiag.runner.decode import supports, why_not
    from tpdiag.runner.logits import whole_vocab
    from tpdiag.runner.losses import loss_context, step_functions

    if cfg.mode == "decode" and not supports(model):
        raise Unavailable(why_not(model))
    if cfg.micro_batch < 1:
        raise BadInput(f"--micro-batch {cfg.micro_batch}: must be >= 1")
    if cfg.mode == "decode" and cfg.padding == "right":
        raise Unavailable("decode pads prompts on the left, as generate() does: right padding would "
                          "put padding between a prompt and its generated tokens")
    if cfg.mode == "decode" and cfg.padding == "packed":
        raise Unavailable("decode has no packed form: generate() left-pads its prompts (packing is a "
                          "trainer's prefill)")
    if cfg.mode == "prefill" and cfg.padding in STATIC_PADDINGS:
        raise Unavailable(f"padding {cfg.padding} is generate(cache_implementation=\"static\")'s decode (a KV "
                          "cache preallocated to its max length); a prefill call has no cache")
    if cfg.padding == "compiled" and _device(model).type not in COMPILING_DEVICES:
        # transformers' _valid_auto_compile_criteria: elsewhere generate() runs a static cache eagerly
        raise Unavailable(f"padding compiled is generate()'s torch.compile'd decode, which it runs only on "
                          f"{' / '.join(COMPILING_DEVICES)}; on {_device(model).type} generate(cache_implementation="
                          "\"static\") is eager: --padding static")
    from tpdiag.runner import recipe as trainer_recipe

    recipe = recipe or trainer_recipe.Recipe()
    names = () if cfg.fix == "none" else resolve("all" if cfg.fix == "all" else cfg.fix.split("+"))
    out: list = [None] * len(seqs)
    with ExitStack() as stack, torch.no_grad():
        snap = stack.enter_context(flags.applied(cfg.flags, _device(model).type))
        if on_flags is not None:
            on_flags(cfg.flags, snap)
        stack.enter_context(attention(model, cfg.attention, Unavailable))
        # every configuration of a run takes the same tree groups G (the largest TP tried), as
        # compare's worlds do: the fixes' bits then do not depend on the TP degree
        stack.enter_context(install_tree_groups(tree_groups))
        stack.enter_context(apply_fixes(names, model=model, plan=target.plan, world=world))
        _, logprob_fn, _ = step_functions(target)
        for start in range(0, len(seqs), cfg.micro_batch):
            idx = list(range(start, min(start + cfg.micro_batch, len(seqs))))
            group = [seqs[i] for i in idx]
            if cfg.mode == "prefill" and cfg.padding == "packed":
                rows = _packed(model, group)
            elif cfg.mode == "prefill":
                rows = _prefill(model, group, left=cfg.padding == "left")
            else:
                rows = _decode(model, group, static=cfg.padding in STATIC_PADDINGS, max_cache_len=max_cache_len,
                               max_new_tokens=max_new_tokens, compiled=cfg.padding == "compiled")
            wholes, undivided = [], []
            for i, r in zip(idx, rows):
                if on_rows is not None:
                    on_rows(i, r)
                # the trainer's logprob function on the logits as the trainer holds them: at TP > 1
                # a vocab-sharded DTensor under loss_parallel (tpdiag.runner.losses)
                r, _ = whole_vocab(r, model, target.plan, target.vocab_size, world)
                if not recipe.default:
                    # the user's recipe on the whole vocabulary: a division or a log-softmax in bf16
                    # rounds per element, the same bits on a shard or the whole
                    # (--compiled: the logits as they are, the whole recipe in one compiled graph below)
                    wholes.append(_whole(r) if recipe.compiled else trainer_recipe.rows(_whole(r), recipe))
                    if recipe.temperature != 1.0:
                        # the processed check reads the engine against the model's own logits: a
                        # trainer's division is the trainer's, not a processing the engine did
                        undivided.append(_whole(r).float())
                    continue
                # logprobs in float32, as an engine takes them (generate()'s output_logits are
                # float32 copies; vLLM's sampler upcasts) and as RL trainers do (NeMo RL, verl):
                # a bf16 log-softmax rounds every logprob to 8 bits
                wholes.append(r.float())
            sharded = world if recipe.default else 1
            if sampling:
                from tpdiag.rollout import sampling as proc

                # generate()'s processors read whole rows: the vocabulary gathered first
                plen = max(s.prompt_len for s in group)
                ids, mask = decode_inputs(group, plen, max(s.n_generated for s in group), pad_id(model))
                wholes = proc.apply(model, sampling, group, [_whole(r) for r in wholes], ids, mask, plen)
                sharded = 1
            for k, (i, s, r) in enumerate(zip(idx, group, wholes)):
                labels = torch.tensor(s.input_ids[1:], device=r.device)
                if recipe.default:
                    with loss_context(sharded):
                        lp = logprob_fn(r, labels)
                else:
                    lp = (trainer_recipe.whole(r, labels, recipe) if recipe.compiled
                          else trainer_recipe.token_logprobs(r, labels, recipe))
                out[i] = _whole(lp).float().cpu()
                if on_logits is not None:
                    on_logits(i, undivided[k] if undivided else _whole(r).float())
    return out


def pad_id(model) -> int:
    """The token generate() pads with when the caller names none: the generation config's pad token,
    else the model config's, else its (first) EOS - an engine pads with its tokenizer's, which is
    this for most checkpoints. Padding is never attended by a real row, but a MoE routes it
    beside them (the experts' GEMM shapes), so the bits can depend on the id."""
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    for cfg in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        for key in ("pad_token_id", "eos_token_id"):
            v = getattr(cfg, key, None) if cfg is not None else None
            if isinstance(v, (list, tuple)):
                v = v[0] if v else None
            if isinstance(v, int) and 0 <= v < (vocab if isinstance(vocab, int) else v + 1):
                return v
    return PAD


def _device(model):
    return next(model.parameters()).device


def _prefill(model, group, left: bool = False) -> list:
    """Logits rows [len - 1, vocab] per sequence from one call: right-padded (causal attention: a
    real position never sees the padding), or left-padded with an attention mask and positions
    counted from each row's first token (an hf: model; others only where nothing is padded)."""
    import torch

    from tpdiag.runner.decode import Unsupported, prefill_logits
    from tpdiag.runner.batch import forward_call
    from tpdiag.runner.logits import logits_of

    longest = max(len(s.input_ids) for s in group)
    ids = torch.full((len(group), longest), pad_id(model), dtype=torch.long)
    mask = torch.zeros((len(group), longest), dtype=torch.long)
    for r, s in enumerate(group):
        n = len(s.input_ids)
        at = longest - n if left else 0
        ids[r, at:at + n] = torch.tensor(s.input_ids)
        mask[r, at:at + n] = 1
    ids = ids.to(_device(model))
    if left:
        try:
            logits = prefill_logits(model, ids, mask.to(ids.device))
        except Unsupported as e:
            raise Unavailable(str(e)) from None
        return [logits[r, longest - len(s.input_ids):longest - 1] for r, s in enumerate(group)]
    args, kwargs = forward_call(model, ids)
    logits = logits_of(model(*args, **kwargs))
    return [logits[r, :len(s.input_ids) - 1] for r, s in enumerate(group)]


def _packed(model, group) -> list:
    """Logits rows per sequence from one call of one row: the micro-batch's sequences end to end,
    position ids restarting at 0 for each, no attention mask and no cache, as TRL and verl pack
    them padding-free. transformers reads the restarts as document boundaries (masking_utils'
    find_packed_sequence_indices) only where the mask is None and there is no cache: a forward with
    its default use_cache=True builds a DynamicCache first, and every document then attends to the
    ones before it. The GEMMs see one row of sum(len) tokens - other shapes than padding's."""
    import torch

    from tpdiag.runner.decode import is_hf

    if not is_hf(model):
        raise Unavailable("padding packed: only hf: models take position ids that restart inside a row "
                          "(a built-in preset or a py: model's forward takes the tokens alone)")
    ids = torch.tensor([[t for s in group for t in s.input_ids]], device=_device(model))
    pos = torch.tensor([[p for s in group for p in range(len(s.input_ids))]], device=ids.device)
    logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits
    out, at = [], 0
    for s in group:
        n = len(s.input_ids)
        out.append(logits[0, at:at + n - 1])
        at += n
    return out


def decode_inputs(group, plen: int, steps: int, pad: int):
    """(ids, mask) [n, plen + steps - 1] of a decode batch, in padded coordinates: each prompt
    right-aligned at plen (left padding, mask 0), then its generated tokens; the batch's last step
    is the longest sequence's last token but one (nothing is predicted from its last). As
    generate() runs it: a sequence that ends early (its EOS) is fed its last token at the next step
    and the pad token after it, both attended (mask 1) - causal, so its own rows never see them,
    but a MoE routes them beside the other rows' tokens, and an expert's batch is a GEMM shape."""
    import torch

    n, L = len(group), plen + steps - 1
    ids = torch.full((n, L), pad, dtype=torch.long)
    mask = torch.ones((n, L), dtype=torch.long)
    for r, s in enumerate(group):
        fed = s.input_ids[:L - plen + s.prompt_len]
        ids[r, plen - s.prompt_len:plen - s.prompt_len + len(fed)] = torch.tensor(fed)
        mask[r, :plen - s.prompt_len] = 0
    return ids, mask


def _decode(model, group, static: bool = False, max_cache_len: int = 0, max_new_tokens: int = 0,
            compiled: bool = False) -> list:
    """Logits rows per sequence the way generate() makes them (tpdiag.runner.decode): prompts
    left-padded in one call whose head computes the last row only (generate()'s logits_to_keep=1,
    as engines do: the head's GEMM at M=1 row is part of what decode means), then one token per
    step through the cache, positions counted from each row's first token.
    static: generate(cache_implementation="static")'s StaticCache, of generate()'s length
    max_length - 1 = the longest prompt + max_new_tokens - 1 (max_new_tokens: generate()'s, as the
    user names it or the whole rollout's most generated tokens - tpdiag.rollout.static_len - never
    fewer than this micro-batch's), or max_cache_len where the user names it. A batch whose
    sequences all stopped at EOS early ran fewer steps, not a shorter cache. The length is the attention's key length at every call: on the
    project's CPU float32 SDPA gave other bits at 17 and 18 keys, bf16 SDPA at fewer than 16 keys
    and at 16 or more (docs/rl.md). compiled: the steps after the prompt through the model's
    torch.compile'd call, generate()'s on a GPU (tpdiag.runner.decode)."""
    import torch

    from tpdiag.runner.decode import Unsupported, decode, prefill_logits

    dev = _device(model)
    n = len(group)
    plen = max(s.prompt_len for s in group)
    steps = max(s.n_generated for s in group)
    ids, mask = decode_inputs(group, plen, steps, pad_id(model))
    ids, mask = ids.to(dev), mask.to(dev)
    try:
        pieces = decode(model, ids, plen, attention_mask=mask, prompt_rows="last",
                        static_len=(max_cache_len or plen + max(steps, max_new_tokens) - 1) if static else None,
                        compiled=compiled)
        prompt_rows = [None] * n
        if any(s.prompt_logprobs is not None for s in group):  # an engine's prompt logprobs: its prefill's rows
            full = prefill_logits(model, ids[:, :plen], mask[:, :plen])
            prompt_rows = [full[r, plen - s.prompt_len:plen - 1] for r, s in enumerate(group)]
    except Unsupported as e:
        raise Unavailable(str(e)) from None
    out = []
    for r, s in enumerate(group):
        gen = torch.cat([p.logits[r] for p in pieces], dim=0)[:s.n_generated]
        head = prompt_rows[r]
        if head is None:  # no prompt logprobs to compare: rows the metrics never read
            head = torch.full_like(gen[:1], float("nan")).expand(s.prompt_len - 1, -1)
        out.append(torch.cat([head, gen], dim=0))
    return out


def _whole(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t
