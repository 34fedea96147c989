"""`tpdiag compare`: validate, run one world per degree, diff against the reference, write RUN_DIR."""
from __future__ import annotations

import os
import platform
import time

from tpdiag.base import files as io
from tpdiag.config import CompareConfig
from tpdiag.errors import BadInput, EnvironmentProblem
from tpdiag.records.provenance import versions


def resolve_device(device: str, degrees) -> str:
    import torch

    need = max(degrees)
    if device == "auto":
        return "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= need else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise EnvironmentProblem("--device cuda: no CUDA device is available here; use --device cpu")
        if torch.cuda.device_count() < need:
            raise EnvironmentProblem(f"--device cuda: TP={need} needs {need} GPUs, "
                                     f"{torch.cuda.device_count()} visible")
        import torch.distributed as dist

        if not dist.is_nccl_available():
            raise EnvironmentProblem("--device cuda: this torch build has no NCCL")
    else:
        import torch.distributed as dist

        if not dist.is_gloo_available():
            raise EnvironmentProblem("--device cpu: this torch build has no gloo backend")
    return device


def validate(cfg: CompareConfig) -> dict:
    """Everything checkable before a world starts: bad input costs nothing. Returns the memory
    preflight (models/preflight.py) for the manifest."""
    from tpdiag.models.spec import check_degrees, parse_spec

    spec = parse_spec(cfg.model, cfg.layers)
    # the axes need no model: checked before anything that builds one (an hf: plan check imports
    # transformers and builds the model on the meta device - seconds on a busy machine)
    check_axes(cfg, spec)
    if cfg.layers:
        from tpdiag.models.capacity import model_dims
        from tpdiag.models.slice import check_layers

        check_layers(spec, cfg.layers, model_dims(spec).get("total_layers") if spec.kind != "py" else None)
    check_degrees(spec, cfg.degrees)
    from tpdiag.models.precheck import check_plan

    check_plan(spec, cfg.degrees, cfg.variant)
    from tpdiag.fixes.registry import catalogue

    checks = [f.check_plan for n, f in catalogue().items() if n in cfg.fixes and f.check_plan]
    if spec.kind == "hf" and checks and max(cfg.degrees) > 1:
        from tpdiag.models.precheck import hf_base_plan

        base = hf_base_plan(spec.value)[1]
        for check in checks:  # a layout a fix does not cover (MoE experts): one line, no world
            check(base)
    if cfg.steps < 1:
        raise BadInput(f"--steps {cfg.steps}: must be >= 1")
    import math

    if not math.isfinite(cfg.timeout) or cfg.timeout <= 0 or cfg.timeout > 7 * 86400:
        raise BadInput(f"--timeout {cfg.timeout:g}: must be a number of seconds in (0, 604800]")
    from tpdiag.kernels.hash_buffer import batch_size, cap_bytes

    batch_size()  # TPDIAG_HASH_BATCH and TPDIAG_HASH_CAP_MB, read by every world's recorder
    cap_bytes()
    from tpdiag.kernels.record_hash import narrow_regs_knob

    narrow_regs_knob()  # TPDIAG_HASH_NARROW_REGS
    from tpdiag.probes.stream import check_env

    check_env()  # TPDIAG_HOST_BUDGET, TPDIAG_HOST_CHUNK (full capture)
    if spec.kind in ("builtin", "hf"):
        from tpdiag.models.plans import HF_VARIANTS, VARIANTS

        offered = VARIANTS if spec.kind == "builtin" else HF_VARIANTS
        if cfg.variant not in offered:
            raise BadInput(f"--variant {cfg.variant!r}: expected one of {', '.join(offered)}"
                           f"{' for an hf: model' if spec.kind == 'hf' else ''}")
    if not 0 <= cfg.seed < 2 ** 63:
        raise BadInput(f"--seed {cfg.seed}: must be in [0, 2**63)")
    if cfg.batch_size < 1 or cfg.seq_len < 2:
        raise BadInput(f"--batch-size {cfg.batch_size} / --seq-len {cfg.seq_len}: need >= 1 and >= 2")
    from tpdiag.models.capacity import guess_device
    from tpdiag.models.preflight import preflight

    # Positions and memory before any world starts: a batch past them fails in seconds, not after
    # minutes of a rank growing until the OOM killer picks a process on a shared host; a model
    # whose reference cannot fit is told which slice (--layers) or reference degree does.
    device = guess_device(cfg.device, cfg.degrees)
    # activations: the fewest sequences any world runs in one call (a lower bound for all of them)
    rows = min(cfg.micro_batches) if cfg.micro_batches and spec.kind != "py" else cfg.batch_size
    pre = preflight(spec, cfg.degrees, max(1, rows), cfg.seq_len, cfg.dtype, cfg.backward, device,
                    cfg.variant, gpus=_gpus(device))
    from tpdiag.config import CAPTURES

    if cfg.capture not in CAPTURES:
        raise BadInput(f"--capture {cfg.capture!r}: expected one of {', '.join(CAPTURES)}")
    if cfg.out and os.path.exists(cfg.out) and not os.path.isdir(cfg.out):
        raise BadInput(f"--out {cfg.out!r}: exists and is not a directory")
    if not cfg.group_gemm:  # a rerun's config was resolved (and checked) with its parent run
        from tpdiag.fixes import groups

        groups.check(cfg.degrees, cfg.fixes, cfg.tree_groups)
    return pre


def _gpus(device: str) -> int | None:
    if device != "cuda":
        return None
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # noqa: BLE001
        return None


def check_axes(cfg: CompareConfig, spec) -> None:
    """The micro-batch and mode axes, before any world starts."""
    from tpdiag.base.points import MODES, check_micro_batches

    if len(cfg.worlds()) < 2:
        raise BadInput(f"--tp {','.join(map(str, cfg.degrees))} --micro-batch "
                       f"{','.join(map(str, cfg.micro_batches)) or '(none)'}: need at least two "
                       "configurations (a reference and one to compare), e.g. --tp 1,2 or --micro-batch 4,1")

    for m in cfg.modes:
        if m not in MODES:  # a CompareConfig built in code, not parsed by axes.parse_modes
            raise BadInput(f"--mode {m}: not a mode; expected one of {', '.join(MODES)}")
    if "decode" in cfg.modes:
        if cfg.modes[0] != "prefill":
            raise BadInput(f"--mode {','.join(cfg.modes)}: the reference must be prefill (decode's calls "
                           "are placed as positions of prefill's records); list prefill first, e.g. "
                           "--mode prefill,decode")
        if cfg.micro_batches:
            raise BadInput("--mode decode with --micro-batch: not supported yet (a decode world "
                           "runs the whole batch, one position per call); compare them in two runs")
        sp = [w.label for w in cfg.worlds() if w.point.mode == "decode" and w.point.tp > 1]
        if cfg.variant == "sp" and sp:
            raise BadInput(f"--variant sp --mode decode: the decode configuration {sp[0]} would shard a "
                           "one-token call along the sequence over several ranks (sequence parallelism "
                           "splits positions; engines decode without it); run decode at TP=1 (a first "
                           "degree of 1, without --grid) or with the stock variant")
    _check_attention_padding(cfg, spec.kind)
    if not cfg.micro_batches:
        return
    if spec.kind == "py":
        # a Target.inputs batch has its own size: checked by the world (runner/micro.py)
        if any(n < 1 for n in cfg.micro_batches):
            raise BadInput(f"--micro-batch {cfg.micro_batches}: every size must be >= 1")
    else:
        check_micro_batches(cfg.micro_batches, cfg.batch_size)


# compare records every module's inputs; eager attention is given other inputs than SDPA (rollout,
# which compares logprobs only, has it). Eager alone - every configuration eager, as a trainer that
# loads with attn_implementation="eager" runs at each of its degrees - compares like with like
EAGER_REFUSED = (
    "--attention eager: not an axis of compare - transformers builds eager attention another mask than "
    "SDPA's (a float mask tensor where SDPA takes none and masks causally itself), so the decoder layers' "
    "recorded inputs are not the same records; `--attention eager` alone runs every configuration eager "
    "(an hf: model, as from_pretrained(..., attn_implementation=\"eager\") loads it); compare SDPA backends "
    "here (e.g. --attention sdpa-math,sdpa-flash) and eager against SDPA on logprobs with tpdiag rollout "
    "FILE --attention eager,sdpa")
EAGER_NOT_HF = (
    "--attention eager: only hf: models switch their attention implementation (transformers' "
    "set_attn_implementation); the built-in presets run SDPA and a py: model runs its own code")


def _check_attention_padding(cfg: CompareConfig, kind: str) -> None:
    """--attention: SDPA backends, or eager alone for an hf: model (beside others refused:
    EAGER_REFUSED); --padding: refused (nothing to pad), so a comparison that would change nothing
    is not run as if it tested something. kind: the model spec's (hf, py, builtin)."""
    from tpdiag.base.configs import ATTENTIONS, PADDINGS

    bad = [p for p in cfg.paddings if p not in PADDINGS]
    if bad:
        raise BadInput(f"--padding {bad[0]}: expected one of {', '.join(PADDINGS)}")
    if any(p != "auto" for p in cfg.paddings):
        raise BadInput(f"--padding {','.join(cfg.paddings)}: not an axis of compare - its sequences fill "
                       "--seq-len (and decode's prompts are all one length), so there is no padding whose side "
                       "could change a bit; compare padding sides on an engine's rollout with tpdiag rollout "
                       "FILE --padding left,right")
    for a in cfg.attentions:
        if a not in ATTENTIONS:
            raise BadInput(f"--attention {a}: expected one of {', '.join(ATTENTIONS)}")
    if "eager" in cfg.attentions and len(cfg.attentions) > 1:
        raise BadInput(EAGER_REFUSED)
    if "eager" in cfg.attentions and kind != "hf":
        raise BadInput(EAGER_NOT_HF)


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


def compare_pass(cfg: CompareConfig, on_status=None, finish: bool = True, records_from: dict | None = None):
    """(summary, RunFiles): one compare pass (every configuration's world, then the diff), and
    its run directory's files as it wrote them, for the session to add its parts to
    (records/run_files.py: the files' one writer). The command - this pass, then the second
    pass, confirmation and fix chain - is runner/session.py's compare_session.

    records_from: {label: world folder} of non-reference configurations an earlier pass of this
    run may already have run (runner/drill.py: the own-input pass after a region pass, whose only
    new work is the reference's float64 re-execution): a world whose config there is this pass's
    (its folders aside) is not run again; its files are linked into this pass's folder."""
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
    for point, label in worlds:
        degree = point.tp
        ref_dir = run.world(labels[0]) if label != labels[0] else ""
        wcfg = cfg.world(point, label, run.world(label), device, ref_dir=ref_dir, reference=label == labels[0])
        earlier = (records_from or {}).get(label) if label != labels[0] else None
        same = _same_world(earlier, wcfg) if earlier else None
        if same:
            files.world(label, _linked(earlier, run.world(label), label, degree, same))
            if same == "without ops":
                without_ops.append(label)
            continue
        res = run_world(wcfg, cfg.timeout, on_status)
        if res.status != "ok":
            failed[label] = res.error
        files.world(label, {"degree": degree, "status": res.status, "wall_s": round(res.wall_s, 3),
                               "error": res.error, **world_timings(res.rank_timings), "numerics": res.numerics})
    if on_status:
        on_status("diff", "running")
    t_diff = time.perf_counter()
    summary = analyse_run(out, labels[0], labels[1:], failed, cfg.degrees[0], base_label,
                          axes={w.label: w for w in configs}, without_ops=tuple(without_ops))
    if cfg.layers:
        summary["slice"] = manifest["slice"]  # the `ran:` line says what ran
    from tpdiag.models.dtypes import checkpoint_dtype

    saved = checkpoint_dtype(cfg.model, cfg.dtype)
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
    return summary, files


# where a world's config names its own folders: two passes' worlds differ there and nowhere else
_FOLDERS = ("out_dir", "ref_dir")


def _same_world(earlier: str, wcfg) -> str | None:
    """How the world folder `earlier` (an earlier pass's, finished ok) ran wcfg: "same" - the same
    settings, configuration, probes and rerun spec, so its records are the ones wcfg's world would
    write (its step is deterministic: pass 1's self-check, and the earlier pass's step fingerprint
    checked against pass 1's); "without ops" - the same, but it also recorded the ops of some
    modules where wcfg records none (the op probe changes no number: the same check), so its
    records less the ops are wcfg's; None - run wcfg."""
    from tpdiag.records.paths import RESULT, WORLD, rank_marker

    try:
        world = io.read_json(os.path.join(earlier, WORLD))
        done = io.read_json(os.path.join(earlier, RESULT)).get("status") == "ok"
    except Exception:  # noqa: BLE001 - no readable world: run it
        return None
    if not done or not all(os.path.isfile(os.path.join(earlier, rank_marker(r, "done")))
                           for r in range(wcfg.point.tp)):
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


def _linked(earlier: str, folder: str, label: str, degree: int, how: str) -> dict:
    """The earlier world's files in this pass's folder (hard links: GBs of records cost nothing;
    a copy where the file system refuses links), and its manifest entry: ok, no time spent, the
    numerics its world recorded (its pass's manifest)."""
    import shutil

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
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)
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
