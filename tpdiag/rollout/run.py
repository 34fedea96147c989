"""`tpdiag rollout`: read the engine's file, recompute the trainer's logprobs in every
configuration asked for, and say how far apart they are, where, why, and which configuration
comes closest to the engine."""
from __future__ import annotations

import itertools
import time
from contextlib import nullcontext
from dataclasses import dataclass

from tpdiag.base.configs import any_static
from tpdiag.errors import BadInput
from tpdiag.rollout.compute import MODES, Config
from tpdiag.rollout.recompute import _compute, _lead, _one_thread, _worlds
from tpdiag.rollout.summary import dtype_note, summarise


@dataclass(frozen=True)
class RolloutConfig:
    file: str
    model: str = "tiny-llama"
    tp: tuple[int, ...] = (1,)
    micro_batch: tuple[int, ...] = (8, 1)
    modes: tuple[str, ...] = MODES
    fixes: tuple[str, ...] = ("none", "all")
    dtype: str = "float32"
    device: str = "cpu"
    seed: int = 1234
    top: int = 10
    timeout: float = 300.0  # seconds per TP > 1 world
    # the axes engines and trainers differ on (rollout/compute.py): the first value of each is
    # the reference's; defaults are what an engine runs (PyTorch's flags, the model's attention)
    flags: tuple[str, ...] = ("default",)
    attention: tuple[str, ...] = ("auto",)
    padding: tuple[str, ...] = ("auto",)
    # concurrent worlds per TP degree (tpdiag.rollout.lanes); 1: TP=1 in this process and one
    # world per other degree, one configuration after another; 0: auto (lanes.lanes_per_degree)
    jobs: int = 1
    # the engine's generate() sampling settings, when its logprobs are its processed scores:
    # ((name, value), ...) whose processors the trainer's rows go through (tpdiag.rollout.sampling)
    sampling: tuple = ()
    # --padding static's cache length (generate()'s max_length - 1, or its max_cache_len); 0: the
    # micro-batch's longest prompt + its most generated tokens - 1 (tpdiag.rollout.compute._decode)
    max_cache_len: int = 0
    # generate()'s max_new_tokens: --padding static's cache length is each micro-batch's longest
    # prompt + it - 1; 0: --sampling's, else the rollout's most generated tokens (rollout/static_len.py)
    max_new_tokens: int = 0
    # the trainer's logprob recipe (tpdiag.runner.recipe.Recipe; None: log_softmax of the float32
    # logits gathered at the token), every configuration's
    recipe: object = None


# the option parsers live in rollout/options.py; importable from here as before
from tpdiag.rollout.options import (parse_fixes, parse_ints, parse_jobs, parse_modes,  # noqa: E402,F401
                                    parse_padding)


def configurations(rc: RolloutConfig) -> list[Config]:
    return [Config(t, m, mode, f, fl, a, pad) for t, m, mode, f, fl, a, pad in
            itertools.product(rc.tp, rc.micro_batch, rc.modes, rc.fixes, rc.flags, rc.attention, rc.padding)]


def run_rollout(rc: RolloutConfig, on_status=None, on_logprobs=None) -> dict:
    """The summary; on_logprobs({label: [float32 tensor per sequence]}) gets every configuration's
    logprobs that ran (tests: the lanes' bits against one process's)."""
    from tpdiag.rollout import metrics
    from tpdiag.rollout.compute import build
    from tpdiag.rollout.read import read_rollout

    t0 = time.perf_counter()
    user_rc = rc
    ro = read_rollout(rc.file)
    seqs = ro.sequences
    from tpdiag.rollout import lanes

    if rc.sampling:
        from tpdiag.models.spec import parse_spec

        kind = parse_spec(rc.model).kind
        if kind != "hf":
            raise BadInput(f"--sampling applies transformers' generate() processors to the trainer's logits: it "
                           f"needs an hf: model, not a {kind} one ({rc.model})")
        from tpdiag.rollout import sampling as rollout_sampling

        rollout_sampling.check(seqs, rc.sampling)
    if rc.recipe is not None:
        from tpdiag.runner.recipe import check_sampling

        check_sampling(rc.recipe, rc.sampling)
    if rc.max_cache_len < 0:
        raise BadInput(f"--max-cache-len {rc.max_cache_len}: must be >= 1 (0: generate()'s, from the sequences)")
    if rc.max_cache_len and not any_static(rc.padding):
        raise BadInput(f"--max-cache-len {rc.max_cache_len}: the length of --padding static's KV cache; add "
                       "static to --padding (e.g. --padding auto,static)")
    from dataclasses import replace

    from tpdiag.rollout import static_len

    # resolved once for the whole file: every lane and world takes the same cache length
    rc = replace(rc, max_new_tokens=static_len.resolve(rc, seqs), max_cache_len=static_len.cache_len(rc, seqs))
    counts = lanes.lanes_per_degree(rc, configurations(rc), seqs)
    jobs = max(counts.values())
    if max(rc.tp) > 1:
        from tpdiag.models.precheck import check_plan
        from tpdiag.models.spec import parse_spec

        check_plan(parse_spec(rc.model), rc.tp)  # before any model is built: no plan, no TP > 1
    if max(rc.tp) > 1 or jobs > 1:
        from tpdiag.runner.start_context import prestart

        # the fork server's imports (torch, transformers: seconds) run while this process builds
        # its model, not after (every world's ranks fork from it; its environment is theirs)
        prestart(rc.model)
    notes = []
    cfgs = configurations(rc)
    big = max(rc.tp)
    if big > 1:
        from tpdiag.models.spec import check_degrees, parse_spec

        check_degrees(parse_spec(rc.model), [t for t in rc.tp if t > 1])
    # the fixes' tree groups: the largest degree, as compare's default (power of two), else the default
    groups = big if big > 1 and not big & (big - 1) else 0
    # lanes: started before this process builds its model, which they do not wait for (rollout/early.py)
    early, saved_env = None, None
    if jobs > 1:
        from tpdiag.rollout.early import start

        early, saved_env = start(rc, seqs, cfgs, counts, groups, big, on_status)
    try:
        target, model = build(rc.model, rc.dtype, rc.device, rc.seed)
        from tpdiag.runner.decode import supports

        decodable = supports(model)  # else --mode decode is no advice: unavailable for this model
        vocab = target.vocab_size
        for s in seqs:
            top = max(s.input_ids)
            if top >= vocab:
                raise BadInput(f"{rc.file} {s.where}: token id {top} is outside the model's vocabulary "
                               f"({vocab}): is --model the engine's model?")
        from tpdiag.models.dtypes import RECAST

        recast = [model.__dict__[RECAST]["note"]] if RECAST in model.__dict__ else []
        notes += (dtype_note(rc) + recast + _static_note(rc) + static_len.note(user_rc, seqs, model)
                  + _micro_batch_note(rc, seqs))
        sampled = None
        if rc.sampling:
            from tpdiag.rollout import sampling

            sampled = {"settings": dict(rc.sampling), "processors": sampling.describe(model, rc.sampling)}
        from tpdiag.rollout import padded

        pad_note = padded.note(seqs, model)  # said only where nothing reproduces the engine (rollout/summary.py)
        from tpdiag.rollout import no_cache

        cache_note = no_cache.note(rc.model)  # likewise
        if big > 1:
            # TP=1 is named only where it ran (`--tp 2` alone: the note said it ran here)
            notes.append("TP > 1 ran in worlds of one process per rank, one thread each (as compare's)"
                         + (f"; TP=1 ran {'in this process' if jobs == 1 else 'here and in lanes'}, on one "
                            "thread too (the fixes' CPU kernels can give other bits with more threads)"
                            if 1 in rc.tp else ""))
        threads = _one_thread() if big > 1 else nullcontext()
        flag_values: dict[str, dict] = {}
        if early is not None:
            with threads:
                # the margins' configuration (the first TP=1 one that runs) here, as one process would;
                # every other configuration in the lanes (a TP=1 one run here too - its first did not
                # run - takes this process's result: the same bits)
                lead, collector, stats_from = _lead(cfgs, seqs, target, model, groups, on_status, flag_values,
                                                   rc.sampling, rc.max_cache_len, rc.max_new_tokens, rc.recipe)
                worlds = {**early.result(), **lead}
                results, trainer, collector, stats_from = _compute(rc, cfgs, worlds, seqs, target, model, groups,
                                                                   on_status, flag_values, collector, stats_from)
            notes.append(f"ran in lanes: {', '.join(f'{n} TP={t}' for t, n in counts.items())} worlds side by "
                         "side, a configuration's micro-batches split between them (tpdiag.rollout.lanes; the "
                         "same bits as --jobs 1)")
        else:
            worlds = _worlds(rc, seqs, [c for c in cfgs if c.tp > 1], groups, on_status)
            with threads:
                results, trainer, collector, stats_from = _compute(rc, cfgs, worlds, seqs, target, model, groups,
                                                                   on_status, flag_values)
        pad_bug = None
        if pad_note is None and not any(metrics.reproduces(seqs, r["metrics"]) for lab, r in results.items()
                                        if lab in trainer):
            from tpdiag.rollout import pad_unmasked

            # nothing reproduces the file: was it a left-padded batch run without its mask or positions?
            with _one_thread() if big > 1 else nullcontext():  # TP=1's threads (a context is single-use)
                pad_bug = pad_unmasked.check(seqs, model, rc.micro_batch)
        mode_bug = None
        if decodable and {"prefill", "decode"} <= set(rc.modes):
            from tpdiag.rollout import mode_gap

            mode_bug = mode_gap.check(cfgs[0], seqs, target, model)  # rounding between the modes, or a bug
        from tpdiag.rollout import own_loss

        own = None
        if own_loss.applies(target):  # a py: Target's own loss: the trainer's logprobs as its code takes them
            with _one_thread() if big > 1 else nullcontext():
                own = own_loss.check(rc, cfgs, results, trainer, seqs, target, model, groups)
    finally:
        if early is not None:
            from tpdiag.rollout.early import put_back

            early.close()  # the lanes ended - or, if this process failed, cancelled
            put_back(saved_env)
    if on_logprobs is not None:
        on_logprobs(trainer)
    for w in worlds.values():
        for k, v in (w.get("flag_values") or {}).items():
            if v:
                flag_values.setdefault(k, v)
    return summarise(rc, ro, seqs, vocab, cfgs, results, trainer, collector, stats_from, notes, t0,
                    flag_values, pad_note, sampled, decodable, cache_note, mode_bug, pad_bug, own)


def _static_note(rc) -> list[str]:
    """On a GPU, generate() compiles its forward when the cache is static (transformers'
    _valid_auto_compile_criteria: cuda and a compileable cache); tpdiag's static decode is eager."""
    if "static" not in rc.padding or "compiled" in rc.padding or "decode" not in rc.modes or rc.device != "cuda":
        return []
    return ['padding static decodes eagerly, as generate(cache_implementation="static", disable_compile=True) '
            "(TRL's GRPOTrainer); without disable_compile generate() runs a static cache's decode steps under "
            "torch.compile on a GPU, other kernels (on an H200 the eager decode matched none of such an engine's "
            "sequences): --padding static,compiled tries both"]


def _micro_batch_note(rc, seqs) -> list:
    """A micro-batch size above the file's sequence count (the default 8 against an engine batch of
    4) runs every sequence in one call: the calls of micro-batch len(seqs), while its label names the
    size asked for - an engine reproduced by `tp1-mb8-...` ran a batch of 4, not 8."""
    n = len(seqs)
    big = [m for m in rc.micro_batch if m > n]
    if not big:
        return []
    said = ", ".join(str(m) for m in big)
    return [f"--micro-batch {said} is more than the file's {n} sequence{'s' if n != 1 else ''}: "
            f"{'its configurations (mb' + said + ')' if len(big) == 1 else 'their configurations'} run "
            f"all {n} in one call, the calls of micro-batch {n} (the default is 8,1): an engine those "
            f"reproduce ran a batch of {n}"]
