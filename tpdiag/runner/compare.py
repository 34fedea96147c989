"""`tpdiag compare`: validate, run one world per degree, diff against the reference, write RUN_DIR."""
from __future__ import annotations

import os
import platform
import time

from tpdiag.base import files as io
from tpdiag.config import CompareConfig
from tpdiag.records.provenance import versions
from tpdiag.runner.checks import resolve_device, validate


def device_info(device: str) -> dict:
    import torch

    info = {"type": device, "host": platform.node(), "cpu": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count()}
    if device == "cuda":
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info


def world_timings(rank_timings: list) -> dict:
    """A world's manifest entry: {'timings': each phase's max over ranks, 'rank_timings': per
    rank}. Phases (s): spawn, process_group, world_start (launch -> first model built and
    sharded), selfcheck (the unprobed run), model (build + init + shard), build (model, batch,
    optimizer), steps (forward/loss/backward/optimizer), gather (capture gathered to rank 0),
    write (rank 0); peak memory (bytes): GPU max_memory_allocated, host max RSS."""
    if not rank_timings:
        return {}
    keys = sorted({k for t in rank_timings for k in t})
    worst = {k: max(t[k] for t in rank_timings if isinstance(t.get(k), (int, float))) for k in keys
             if any(isinstance(t.get(k), (int, float)) for t in rank_timings)}
    # a label every rank agrees on (the init path: 'sharded' or 'whole') is kept as it is
    worst.update({k: rank_timings[0][k] for k in keys if k not in worst and isinstance(
        rank_timings[0].get(k), str) and all(t.get(k) == rank_timings[0][k] for t in rank_timings)})
    return {"timings": {k: (round(v, 4) if isinstance(v, float) else v) for k, v in worst.items()},
            "rank_timings": [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in t.items()}
                             for t in rank_timings]}


def compare_phases(worlds: dict, labels: list, base_label: str | None, diff_s: float) -> dict:
    """Wall time (s) of each phase of one compare: the reference world, its rerun (determinism
    check), each other degree's world, and the diff."""
    def wall(label):
        w = worlds.get(label)
        return w.get("wall_s") if isinstance(w, dict) else None

    return {"reference_s": wall(labels[0]),
            "reference_rerun_s": wall(base_label) if base_label else None,
            "degrees_s": {lab: wall(lab) for lab in labels[1:]},
            "diff_s": round(diff_s, 3)}


def default_out() -> str:
    return os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))


def compare_pass(cfg: CompareConfig, on_status=None, finish: bool = True, records_from: dict | None = None,
                 first: str | None = None):
    """(summary, RunFiles): one compare pass (every configuration's world, then the diff), and
    its run directory's files as it wrote them, for the session to add its parts to
    (records/run_files.py: the files' one writer). The command - this pass, then the second
    pass, confirmation and fix chain - is runner/session.py's compare_session.

    records_from: {label: world folder} of non-reference configurations an earlier pass of this
    run may already have run (runner/drill.py: the own-input pass after a region pass, whose only
    new work is the reference's float64 re-execution): a world whose config there is this pass's
    (its folders aside) is not run again; its files are linked into this pass's folder.
    first: pass 1's run directory, for a second pass whose two worlds may run at once
    (runner/side_by_side.pair_gpu reads there what each world's pass-1 twin was)."""
    from tpdiag.diff.analyse import analyse_run
    from tpdiag.runner.determinism import numerics_env
    from tpdiag.kernels.record_hash_ref import HASH_VERSION  # the lane mix its worlds hash with
    from tpdiag.records.paths import RunDir
    from tpdiag.records.run_files import RunFiles
    from tpdiag.runner.launch import run_world

    from tpdiag.fixes import groups

    t_start = time.perf_counter()
    pre = validate(cfg)
    cfg = groups.resolve(cfg)
    device = resolve_device(cfg.device, cfg.degrees)
    out = cfg.out or default_out()
    os.makedirs(out, exist_ok=True)
    run = RunDir(out)
    configs = cfg.worlds()
    labels = [w.label for w in configs]
    from tpdiag.base.points import recorded_axes

    shown = recorded_axes(configs)
    backend = "nccl" if device == "cuda" else "gloo"
    manifest = {
        "schema": 1, "tool": "tpdiag compare", "versions": versions(device), "hash_version": HASH_VERSION,
        "device": device_info(device), "backend": backend, "model": cfg.model, "dtype": cfg.dtype,
        "seed": cfg.seed, "degrees": list(cfg.degrees), "labels": labels, "reference": labels[0],
        "configurations": {w.label: {**w.point.to_dict(shown), "axis": w.axis} for w in configs},
        "fixes": list(cfg.fixes), "tree_groups": cfg.tree_groups, "group_gemm": cfg.group_gemm,
        "config": cfg.to_dict(), "env": numerics_env(), "flags": cfg.flags,
        # this process's intra-op threads (runner/host_threads.py; the ranks' are each world's)
        "launcher_threads": _threads(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "preflight": pre, "worlds": {},
    }
    if cfg.layers:
        from tpdiag.models.slice import describe

        from tpdiag.models.spec import parse_spec, slice_changes

        manifest["slice"] = {"layers": cfg.layers, "total_layers": pre.get("total_layers"),
                             "what": describe(cfg.layers, pre.get("total_layers")),
                             "config": slice_changes(parse_spec(cfg.model, cfg.layers))}
    files = RunFiles(out, manifest)
    failed: dict[str, str] = {}
    t0 = time.perf_counter()
    setup_s = t0 - t_start  # checks, device, the manifest's versions
    worlds = [(w.point, w.label) for w in configs]
    without_ops: list = []  # linked worlds read without their op records (_same_world)
    base_label = None
    if cfg.baseline and cfg.degrees.count(cfg.degrees[0]) == 1:
        base_label = configs[0].point.with_(repeat="base").compare_key(configs[0].point)  # '1-base'
        worlds.insert(1, (configs[0].point, base_label))
    def world_cfg(point, label):
        ref_dir = run.world(labels[0]) if label != labels[0] else ""
        return cfg.world(point, label, run.world(label), device, ref_dir=ref_dir, reference=label == labels[0])

    def record(label, degree, res, **where):
        if res.status != "ok":
            failed[label] = res.error
        files.world(label, {"degree": degree, "status": res.status, "wall_s": round(res.wall_s, 3),
                            "error": res.error, **world_timings(res.rank_timings), "numerics": res.numerics,
                            **where})

    from tpdiag.runner import prefetch

    prefetch.start()  # what the diff imports, while the worlds run
    beside = None  # the reference's rerun, run beside it on another GPU (runner/side_by_side.py)
    if base_label is not None and not (records_from or {}).get(labels[0]):  # not a reference with a base
        from tpdiag.runner.side_by_side import side_gpu

        base_cfg = world_cfg(*worlds[1])
        offset = side_gpu(device, world_cfg(*worlds[0]), base_cfg)
        if offset:
            beside = (base_cfg, offset)
    pair = None  # the reference's GPU beside the pass's one other world (runner/side_by_side.py)
    if beside is None and first and not records_from and len(worlds) == 2:
        from tpdiag.runner.side_by_side import pair_gpu

        pair = pair_gpu(device, world_cfg(*worlds[0]), world_cfg(*worlds[1]), first)
    for point, label in worlds:
        degree = point.tp
        if pair is not None and label == labels[0]:
            continue  # run with the other world
        if pair is not None:
            from tpdiag.runner.side_by_side import run_beside

            ref_res, res, gpu = run_beside(world_cfg(*worlds[0]), world_cfg(point, label), cfg.timeout,
                                           on_status, pair)
            record(labels[0], worlds[0][0].tp, ref_res,
                   **({"gpu": gpu, "beside": label} if gpu is not None else
                      {"beside_failed": "ran again alone after the other world"}))
            record(label, degree, res)
            continue
        wcfg = world_cfg(point, label)
        earlier = (records_from or {}).get(label) if label != labels[0] else None
        based = (records_from or {}).get(label) if label == labels[0] else None
        if based and _base_world(based, wcfg):
            # the own-input pass's reference: it runs the step (its float64 re-executions need the
            # module's state there) but writes only its float64 records; the rest are the region
            # reference's, read from its folder (records/store.py) - ~1.4 GB not written again
            wcfg = wcfg.with_(records_base=based)
        same = _same_world(earlier, wcfg) if earlier else None
        if same:
            files.world(label, _linked(earlier, run.world(label), label, degree, same))
            if same == "without ops":
                without_ops.append(label)
            continue
        if beside is not None and label == base_label:
            continue  # run with the reference
        if beside is not None and label == labels[0]:
            from tpdiag.runner.side_by_side import run_pair

            res, base, offset = run_pair(wcfg, beside[0], cfg.timeout, on_status, beside[1])
            record(label, degree, res, gpu=0)
            record(base_label, degree, base, gpu=offset,
                   **({"beside": labels[0]} if offset else {"beside_failed": "ran again on GPU 0 after the reference"}))
            continue
        record(label, degree, run_world(wcfg, cfg.timeout, on_status),
               **({"records_base": wcfg.records_base} if wcfg.records_base else {}))
    if on_status:
        on_status("diff", "running")
    t_diff = time.perf_counter()
    summary = analyse_run(out, labels[0], labels[1:], failed, cfg.degrees[0], base_label,
                          axes={w.label: w for w in configs}, without_ops=tuple(without_ops))
    if cfg.layers:
        summary["slice"] = manifest["slice"]  # the `ran:` line says what ran
    from tpdiag.models.dtypes import checkpoint_dtype

    saved = checkpoint_dtype(cfg.model, cfg.dtype)
    # a py: FUNC's bf16 model recast to float32 (the default) is not the model the user's code runs
    saved = saved or ((manifest["worlds"].get(labels[0]) or {}).get("numerics") or {}).get("recast")
    if saved:  # a bf16 checkpoint run in float32 (the default) is not the model the user loads
        summary["checkpoint_dtype"] = saved
    # the summary before the manifest's status: a manifest with one says the summary is this run's
    files.summary(summary)
    phases = {"setup_s": round(setup_s, 3), **compare_phases(
        manifest["worlds"], labels, base_label, time.perf_counter() - t_diff)}
    # the whole call, setup included: a rerun's (confirm, fix chain) part of the breakdown
    # finish=False: the caller has more passes to run into this directory (the second pass, the fix
    # chain) and gives the manifest its status after them; until then the run reads as incomplete,
    # so a compare killed during them never leaves this pass's summary looking like the whole run's
    files.add(phases=phases, wall_s=round(time.perf_counter() - t_start, 3),
              **({"status": summary["status"]} if finish else {}))
    if on_status:
        on_status("diff", "ok")
    summary["run_dir"] = out
    summary["flags"] = _flags_summary(cfg.flags, manifest["worlds"], labels)
    from tpdiag.runner.recipe import Recipe

    recipe = Recipe.of(cfg)
    if not recipe.default:  # the recorded logprobs are the trainer's recipe (manifest config: logprob)
        summary["logprob_recipe"] = {**recipe.to_dict(), "formula": recipe.describe()}
    return summary, files


# where a world's config names its own folders: two passes' worlds differ there and nowhere else
_FOLDERS = ("out_dir", "ref_dir")


def _finished(earlier: str, ranks: int) -> dict | None:
    """The world.json of the world folder `earlier` where that world finished ok (its result and
    every rank's done marker), else None."""
    from tpdiag.records.paths import RESULT, WORLD, rank_marker

    try:
        world = io.read_json(os.path.join(earlier, WORLD))
        done = io.read_json(os.path.join(earlier, RESULT)).get("status") == "ok"
    except Exception:  # noqa: BLE001 - no readable world
        return None
    if not done or not isinstance(world, dict) or not all(
            os.path.isfile(os.path.join(earlier, rank_marker(r, "done"))) for r in range(ranks)):
        return None
    return world


def _same_world(earlier: str, wcfg) -> str | None:
    """How the world folder `earlier` (an earlier pass's, finished ok) ran wcfg: "same" - the same
    settings, configuration, probes and rerun spec, so its records are the ones wcfg's world would
    write (its step is deterministic: pass 1's self-check, and the earlier pass's step fingerprint
    checked against pass 1's); "without ops" - the same, but it also recorded the ops of some
    modules where wcfg records none (the op probe changes no number: the same check), so its
    records less the ops are wcfg's; None - run wcfg."""
    world = _finished(earlier, wcfg.point.tp)
    if world is None:
        return None
    mine, theirs = wcfg.to_dict(), world.get("config")
    if not isinstance(theirs, dict):
        return None
    mine, theirs = ({k: v for k, v in d.items() if k not in _FOLDERS} for d in (mine, theirs))
    if mine == theirs:
        return "same"
    ops = ("granularity", "op_include")
    if (mine.get("granularity"), mine.get("op_include")) == ("module", []) and theirs.get("granularity") == "op" \
            and {k: v for k, v in mine.items() if k not in ops} == {k: v for k, v in theirs.items() if k not in ops}:
        return "without ops"
    return None


def _base_world(earlier: str, wcfg) -> bool:
    """Whether wcfg (a reference world) may write only its float64 records and read the rest from the
    world folder `earlier` (an earlier pass's reference, finished ok): a prefill world of one rank that
    records the earlier world's ops or none, whose config is the earlier world's but for its folders
    and its float64 re-execution (records/store.py: base_problem, which the reader checks again, fingerprints too).
    TPDIAG_OWN_REF_BASE=0: it writes every record (the A/B: tests/test_own_pass_links.py)."""
    from tpdiag.records.base_world import base_problem

    if os.environ.get("TPDIAG_OWN_REF_BASE", "1") == "0" or not wcfg.rerun.oracle_own:
        return False
    p = wcfg.point
    if (p.tp, p.micro_batch, p.mode) != (1, 0, "prefill"):
        return False
    world = _finished(earlier, 1)
    if world is None:  # no finished world there: the reference writes its own
        return False
    mine = {"config": wcfg.with_(records_base=earlier).to_dict(), "label": wcfg.label, "degree": p.tp,
            "fingerprint": world.get("fingerprint")}  # the step's is checked where the records are read
    return base_problem(mine, world, earlier) is None


def _linked(earlier: str, folder: str, label: str, degree: int, how: str) -> dict:
    """The earlier world's files in this pass's folder (hard links: GBs of records cost nothing;
    a copy where the file system refuses links), and its manifest entry: ok, no time spent, the
    numerics its world recorded (its pass's manifest)."""
    import shutil

    from tpdiag.records import checked
    from tpdiag.records.rundir import read_manifest

    try:
        numerics = read_manifest(os.path.dirname(earlier))["worlds"][label].get("numerics")
    except Exception:  # noqa: BLE001 - the manifest's numerics are a record of what ran, not evidence
        numerics = None

    from tpdiag.runner.launch import drop_markers

    drop_markers(folder)  # an earlier run's rank markers here, as run_world drops them
    for name in sorted(os.listdir(earlier)):
        src, dst = os.path.join(earlier, name), os.path.join(folder, name)
        if not os.path.isfile(src) or os.path.islink(src):
            continue
        if os.path.exists(dst):
            os.remove(dst)
        before = checked.identity(src)
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)
        else:
            # the link moved the file's change time: what this compare hash-checked in it stays checked
            checked.linked(before, checked.identity(dst))
    return {"degree": degree, "status": "ok", "wall_s": 0.0, "error": None, "numerics": numerics,
            "records_from": earlier, **({"records_read": "without its op records"} if how == "without ops" else {})}


def _flags_summary(setting: str, worlds: dict, labels: list) -> dict:
    """The reference world's backend flags as it recorded them, which SDPA backend each world's
    attention ran (runner/sdpa_ran.py), and both in one line."""
    from tpdiag.base.configs import folder
    from tpdiag.runner.flags import one_line
    from tpdiag.runner.sdpa_ran import in_words

    values = ((worlds.get(labels[0]) or {}).get("numerics") or {}).get("flag_values")
    ran = {folder(lab): w["numerics"]["sdpa_ran"] for lab, w in worlds.items()
           if isinstance((w or {}).get("numerics"), dict) and "sdpa_ran" in w["numerics"]}
    line = one_line(values, setting) if values else f"flags {setting}: not recorded"
    if ran:
        line += f"; SDPA backend that ran: {in_words(ran)}"
    return {"setting": setting, "values": values, **({"sdpa_ran": in_words(ran)} if ran else {}), "line": line}


def _threads() -> int:
    import torch

    return torch.get_num_threads()
