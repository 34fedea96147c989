"""Every configuration's logprobs for `tpdiag rollout` (rollout/run.py): the TP=1 ones in this
process, the TP > 1 ones in worlds (rollout/world.py) one degree after another, or taken from the
lanes (rollout/early.py) where they ran there."""
from __future__ import annotations

import time
from contextlib import contextmanager

from tpdiag.base.configs import folder


def _lead(cfgs, seqs, target, model, groups, on_status, flag_values, sampling=(), max_cache_len=0,
          max_new_tokens=0, recipe=None):
    """The TP=1 configurations up to the first that runs, here, the first with the margins'
    collector - as _compute takes them: ({label: world-style entry}, collector, its label)."""
    from tpdiag.rollout import processed

    collector = processed.Collector(seqs)
    out = {}
    for c in cfgs:
        if c.tp != 1:
            continue
        entry, lps = _in_process(c, seqs, target, model, groups, on_status, flag_values, collector, sampling,
                                 max_cache_len, max_new_tokens, recipe)
        out[c.rollout_name()] = {**entry, **({"logprobs": lps} if lps is not None else {})}
        if lps is not None or entry["status"] == "ok":
            return out, collector, c.rollout_name()
    return out, collector, None


def _in_process(c, seqs, target, model, groups, on_status, flag_values, hook, sampling=(), max_cache_len=0,
                max_new_tokens=0, recipe=None):
    """(entry: status, reason, seconds, sdpa_ran; logprobs or None) of one TP=1 configuration."""
    from tpdiag.rollout.compute import Unavailable, logprobs
    from tpdiag.runner.sdpa_ran import SdpaRan

    if on_status:
        on_status(c.rollout_name(), "running")
    entry = {"status": "ok"}
    ran = SdpaRan()
    t1 = time.perf_counter()
    lps = None
    try:
        with ran:
            lps = logprobs(c, target, model, seqs, on_logits=hook, tree_groups=groups,
                           on_flags=lambda k, v: flag_values.setdefault(k, v), sampling=sampling,
                           max_cache_len=max_cache_len, max_new_tokens=max_new_tokens, recipe=recipe)
    except Unavailable as e:
        entry.update(status="unavailable", reason=str(e))
    except Exception as e:  # noqa: BLE001 - one configuration failing leaves the others
        # (e.g. an SDPA backend this device has no kernel for), as in the TP > 1 worlds
        entry.update(status="failed", reason=f"{type(e).__name__}: "
                                             f"{str(e).splitlines()[0] if str(e) else ''}"[:300])
    entry.update(seconds=round(time.perf_counter() - t1, 3), sdpa_ran=ran.counts)
    return entry, lps


def _compute(rc, cfgs, worlds, seqs, target, model, groups, on_status, flag_values, collector=None,
             stats_from=None):
    """Every configuration's entry and logprobs, in order: from `worlds` (computed elsewhere:
    TP > 1 worlds, lanes, _lead) where it is there, else here."""
    from tpdiag.rollout import metrics, processed

    results: dict[str, dict] = {}
    trainer: dict[str, list] = {}
    collector = collector if collector is not None else processed.Collector(seqs)
    for c in cfgs:
        entry = {**c.to_dict(), "status": "ok"}
        if c.rollout_name() in worlds:
            w = worlds[c.rollout_name()]
            entry.update(seconds=w.get("seconds"), sdpa_ran=w.get("sdpa_ran") or {},
                         **({"world_seconds": w["world_seconds"]} if "world_seconds" in w else {}))
            lps = [x if hasattr(x, "dtype") else _tensor(x) for x in w["logprobs"]] if w["status"] == "ok" else None
            if lps is None:
                entry.update(status=w["status"], reason=w.get("reason"))
        else:
            hook = None
            if stats_from is None:
                hook, stats_from = collector, c.rollout_name()
            got, lps = _in_process(c, seqs, target, model, groups, on_status, flag_values, hook, rc.sampling,
                                   rc.max_cache_len, rc.max_new_tokens, rc.recipe)
            entry.update(got)
            if lps is None and hook is not None:
                stats_from = None
        if lps is not None:
            bad = metrics.non_finite(seqs, lps, sampled=bool(rc.sampling))
            if bad:
                entry.update(status="failed", reason=bad)
            else:
                entry["metrics"] = metrics.summarise(seqs, lps, sampled=bool(rc.sampling))
                # the first configuration before it with the same bits on every compared token
                entry["same_bits_as"] = next((lab for lab, other in trainer.items()
                                              if metrics.same_bits(seqs, lps, other)), None)
                trainer[c.rollout_name()] = lps
        if c.tp == 1 and c.rollout_name() not in worlds and on_status:
            on_status(c.rollout_name(), entry["status"])
        results[c.rollout_name()] = entry
    return results, trainer, collector, stats_from


def _tensor(values):
    import torch

    return torch.tensor([float("nan") if isinstance(v, str) else v for v in values], dtype=torch.float32)


def _worlds(rc, seqs, cfgs, groups: int, on_status) -> dict:
    """Every configuration in `cfgs`' logprobs from worlds: one per TP > 1 degree, one after another
    (tpdiag.rollout.world; --jobs 1 - the lanes are tpdiag.rollout.early's)."""
    if not cfgs:
        return {}
    import os
    import shutil
    import tempfile

    from tpdiag.runner.determinism import RANK_ENV
    from tpdiag.runner.start_context import prestart

    # the launcher exports the rank environment (CUBLAS_WORKSPACE_CONFIG among it) into this
    # process; TP=1 runs here afterwards, under its own configurations' flags: put it back
    saved_env = {k: os.environ.get(k) for k in RANK_ENV}
    prestart(rc.model)
    work = tempfile.mkdtemp(prefix="tpdiag-rollout-")
    try:
        return _degrees(rc, seqs, cfgs, groups, on_status, work)
    finally:
        from tpdiag.rollout.early import put_back

        shutil.rmtree(work, ignore_errors=True)
        put_back(saved_env)


def _degrees(rc, seqs, cfgs, groups, on_status, work) -> dict:
    from tpdiag.rollout.world import run_degree

    out = {}
    for t in dict.fromkeys(c.tp for c in cfgs):
        mine = [c for c in cfgs if c.tp == t]
        if on_status:
            on_status(folder(t), "running")
        t0 = time.perf_counter()
        res = run_degree(t, rc, seqs, mine, work, groups)
        secs = round(time.perf_counter() - t0, 3)
        for c in mine:
            # a configuration's own compute seconds; world_seconds: its whole world's, start-up included
            r = res.get(c.rollout_name(), {"status": "failed", "reason": "no result"})
            out[c.rollout_name()] = {**r, "seconds": r.get("seconds", secs), "world_seconds": secs}
        if on_status:
            on_status(folder(t), "done")
    return out


@contextmanager
def _one_thread():
    """TP=1 on one thread, as the worlds' ranks run (tpdiag.runner.determinism)."""
    import torch

    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(saved)
