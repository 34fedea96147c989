"""`tpdiag compare` (and its variant matrix) and `tpdiag confirm`: the commands that run worlds."""
from __future__ import annotations

from typing import Annotated, Optional

import typer

from tpdiag.cli import options as H
from tpdiag.cli.common import (DEBUG, FAIL_HELP, QUIET_HELP, Debug, Format, check_format, console, emit_summary,
                               exit_for, fail, print_rank_tracebacks, reported)
from tpdiag.errors import TpdiagError


def _one_flags(text: str) -> str:
    from tpdiag.errors import BadInput
    from tpdiag.runner.flags import parse

    got = parse("--flags", text)
    if len(got) != 1:
        raise BadInput(f"--flags {text!r}: compare runs one setting (deterministic or default); "
                       "run it once per setting")
    return got[0]

def compare(
    model: Annotated[str, typer.Option(help=H.model())] = "tiny-llama",
    tp: Annotated[str, typer.Option(help="degrees, the first is the reference")] = "1,2,4,8",
    dtype: Annotated[str, typer.Option(help=H.choice("DTYPES"))] = "float32",
    device: Annotated[str, typer.Option(help=f"{H.choice('DEVICES')} (auto: cuda with NCCL when enough GPUs, "
                                             "else cpu with gloo)")] = "auto",
    backward: Annotated[bool, typer.Option("--backward/--forward-only",
                                           help="also run the backward pass and the optimizer step "
                                                "(gradients, grad norm, updated parameters)")] = True,
    steps: Annotated[int, typer.Option(help="training steps (forward, backward, optimizer) recorded at "
                                            "each degree")] = 1,
    anchor: Annotated[bool, typer.Option("--anchor/--no-anchor", help=H.ANCHOR)] = True,
    fix: Annotated[str, typer.Option(help=H.fix())] = "none",
    confirm: Annotated[bool, typer.Option("--confirm/--no-confirm",
                                          help="rerun each divergent degree with the fix for its located "
                                               "cause to confirm it")] = True,
    granularity: Annotated[str, typer.Option(help=f"{H.choice('GRANULARITIES')} (module: module records, then "
                                                  "the ops inside the first divergent module in a second pass "
                                                  "whenever its verdict needs them; op: every compute op in "
                                                  "the first pass; auto: that second pass always)")] = "module",
    capture: Annotated[str, typer.Option(
        help="full (every record whole) | hash (hashes + statistics on the device, whole values "
             "for the first divergence only, in a second pass) | auto (hash above 100M params)")] = "auto",
    out: Annotated[Optional[str], typer.Option(help="run directory (default runs/DATE)")] = None,
    timeout: Annotated[float, typer.Option(help="seconds per TP world")] = 300.0,
    seed: Annotated[int, typer.Option(help="seed for weights and batch")] = 1234,
    batch_size: Annotated[int, typer.Option(help="sequences per batch")] = 2,
    seq_len: Annotated[int, typer.Option(help="tokens per sequence")] = 16,
    layers: Annotated[int, typer.Option(help=H.LAYERS)] = 0,
    variant: Annotated[str, typer.Option(help=H.variant())] = "stock",
    variants: Annotated[Optional[str], typer.Option(help=H.variants())] = None,
    baseline: Annotated[bool, typer.Option("--baseline/--no-baseline",
                                           help="rerun the reference against itself first")] = True,
    judge_downstream: Annotated[bool, typer.Option(
        "--judge-downstream/--no-judge-downstream",
        help="judge each divergent module past the first divergence in float64 from its own "
             "inputs, so a bug behind a harmless reordering is found (on by default; "
             "--no-judge-downstream judges the first divergence only)")] = True,
    micro_batch: Annotated[Optional[str], typer.Option(help=H.micro_batch())] = None,
    mode: Annotated[Optional[str], typer.Option(help=H.mode())] = None,
    grid: Annotated[bool, typer.Option("--grid", help=H.grid())] = False,
    attention: Annotated[Optional[str], typer.Option(help=H.attention())] = None,
    padding: Annotated[Optional[str], typer.Option(help=H.PADDING)] = None,
    flags: Annotated[str, typer.Option(help="backend flags of every world: deterministic (reproducible: "
                                            "deterministic algorithms, no TF32, no reduced-precision "
                                            "reductions) or default (PyTorch's own, what engines and "
                                            "trainers run); the table in docs/rl.md")] = "deterministic",
    logprob: Annotated[str, typer.Option(help=H.LOGPROB)] = "log-softmax",
    trainer_temperature: Annotated[float, typer.Option(help=H.TRAINER_TEMPERATURE)] = 1.0,
    temperature_in: Annotated[str, typer.Option(help=H.TEMPERATURE_IN)] = "float32",
    compiled: Annotated[bool, typer.Option("--compiled", help=H.COMPILED)] = False,
    tree_groups: Annotated[Optional[int], typer.Option(
        help="tree groups G of the invariant fixes: a power of two every degree divides (default: "
             "TPDIAG_TREE_GROUPS, else the largest degree - which then runs one plain GEMM per "
             "rank; docs/causes.md)")] = None,
    fmt: Format = "text",
    fail_on_divergence: Annotated[bool, typer.Option("--fail-on-divergence", help=FAIL_HELP)] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help=QUIET_HELP)] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help=H.VERBOSE)] = False,
    debug: Debug = False,
) -> None:
    """Run the model at each TP degree and find the first op that differs from the reference."""
    DEBUG["on"] = debug
    import time

    entered = time.perf_counter()  # the time breakdown's start: the input checks count too
    with reported():
        from tpdiag.runner.start_context import refuse_rerun

        refuse_rerun()  # a rank re-running a script's unguarded call to this command leaves at once
        from tpdiag.config import (CAPTURES, DEVICES, DTYPES, GRANULARITIES, CompareConfig, parse_choice,
                                   parse_degrees)
        from tpdiag.fixes.registry import resolve

        fmt = check_format(fmt)
        fix_mode = fix.strip().lower()
        fixes = () if fix_mode in ("auto", "none") else resolve(fix_mode)
        from tpdiag.runner import recipe as trainer_recipe

        rp = trainer_recipe.parse(logprob, trainer_temperature, temperature_in, compiled)
        cfg = CompareConfig.of(
            model=model, degrees=parse_degrees(tp, 1 if micro_batch or mode or attention else 2), dtype=parse_choice("--dtype", dtype, DTYPES),
            device=parse_choice("--device", device, DEVICES), backward=backward, steps=steps, anchor=anchor,
            fixes=fixes, fix_mode=fix_mode if fix_mode in ("auto", "none", "all") else "explicit",
            confirm=confirm, granularity=parse_choice("--granularity", granularity, GRANULARITIES),
            capture=parse_choice("--capture", capture, CAPTURES), out=out or "", timeout=timeout,
            seed=seed, variant=variant, baseline=baseline, judge_downstream=judge_downstream, batch_size=batch_size, seq_len=seq_len, layers=layers,
            tree_groups=0 if tree_groups is None else tree_groups, flags=_one_flags(flags),
            logprob=rp.name, trainer_temperature=rp.temperature, temperature_in=rp.divide_in,
            logprob_compiled=rp.compiled,
            **H.axes(micro_batch, mode, grid, attention, padding))
        from tpdiag.records.lock import refuse_if_held

        refuse_if_held(cfg.out)
        from tpdiag.runner.launch import prestart

        prestart(cfg.model)  # the fork server's imports overlap the checks below
        from tpdiag.runner.launch import prewarm

        prewarm(cfg.device, cfg.degrees, cfg.dtype, cfg.model, cfg)  # GPUs: Triton's compiles overlap them too
        from tpdiag.runner.compare import default_out, validate
        from tpdiag.runner.session import compare_session

        validate(cfg)
        from tpdiag.runner import host_threads

        host_threads.apply(cfg.device, cfg.degrees)  # the diff's threads on a CPU (docs/usage: threads)
        if not cfg.out:
            cfg = cfg.with_(out=default_out())
        from tpdiag.records.lock import hold

        with hold(cfg.out) as stale:  # one writer per run directory: a second compare is refused
            if stale:
                console(stderr=True).print(f"note: {stale}", markup=False, soft_wrap=True)
            if variants is not None:
                return _compare_matrix(cfg, variants, variant, fmt, fail_on_divergence, quiet)
            if fmt == "text":
                from tpdiag.cli.progress import progress

                with progress(console(stderr=True), cfg, quiet) as on_status:
                    summary = compare_session(cfg, on_status, started=entered)
            else:
                summary = compare_session(cfg, started=entered)
    skipped = None
    if "baseline" not in summary:  # say why the reference was not rerun: no baseline line reads as a pass
        skipped = ("--no-baseline" if not cfg.baseline
                   else f"TP={cfg.degrees[0]} is rerun among the degrees instead")
    emit_summary(summary, fmt, baseline_skipped=skipped)
    if verbose and fmt == "text":
        from tpdiag.cli.timing import print_time

        print_time(console(), summary.get("run_dir"))
    if debug:
        print_rank_tracebacks(summary.get("run_dir"))
    exit_for(summary, fail_on_divergence)


def _compare_matrix(cfg, variants: str, variant: str, fmt: str, fail_on_divergence: bool,
                    quiet: bool = False) -> None:
    """`compare --variants`: every variant at every degree (tpdiag/runner/matrix.py)."""
    with reported():
        from tpdiag.errors import BadInput
        from tpdiag.runner.matrix import parse_variants, run_matrix

        if cfg.fix_mode != "none":
            raise BadInput(f"--fix {cfg.fix_mode if cfg.fix_mode != 'explicit' else ','.join(cfg.fixes)} "
                           "with --variants: name fixes in the variants instead, e.g. --variants stock,fix:all")
        if variant != "stock":
            raise BadInput(f"--variant {variant} with --variants: name the plan in the variants instead, "
                           "e.g. --variants stock,stable")
        vs = parse_variants(variants, cfg)
        if fmt == "text":
            from tpdiag.cli.progress import progress

            with progress(console(stderr=True), cfg, quiet) as on_status:
                summary = run_matrix(cfg, vs, on_status)
        else:
            summary = run_matrix(cfg, vs)
    emit_summary(summary, fmt)
    if fmt == "text":
        from tpdiag.cli.tables import matrix_table

        matrix_table(console(), summary["matrix"])
    if DEBUG["on"]:
        import os

        for name, r in summary["matrix"]["runs"].items():
            print_rank_tracebacks(os.path.join(summary["run_dir"], r["run_dir"]), name)
    if summary["matrix"]["status"] == "inconclusive":
        raise typer.Exit(2)
    exit_for(summary, fail_on_divergence)

def confirm_cmd(
    run_dir: Annotated[str, typer.Argument(help="a run directory written by tpdiag compare")],
    degree: Annotated[Optional[str], typer.Option(help="only this degree label (as in summary.json: 2, or 1-2 "
                                                       "for a rerun)")] = None,
    fix: Annotated[Optional[str], typer.Option(help="swap in this fix instead of the cause's own: one of "
                                                    + ", ".join(H.fix_names()))] = None,
    fmt: Format = "text",
    debug: Debug = False,
) -> None:
    """Rerun a compare's divergent degrees with the fix for their located cause.

    RUN_DIR: the --out directory of a tpdiag compare run."""
    DEBUG["on"] = debug
    try:
        from tpdiag.runner.start_context import refuse_rerun

        refuse_rerun()  # a rank re-running a script's unguarded call to this command leaves at once
        from tpdiag.config import CompareConfig
        from tpdiag.errors import BadInput
        from tpdiag.fixes.registry import resolve
        from tpdiag.records.check import require_run_dir
        from tpdiag.records.confirmable import require_confirmable
        from tpdiag.records.rundir import read_manifest, read_summary
        from tpdiag.runner.confirm import confirm

        fmt = check_format(fmt)
        require_run_dir(run_dir)
        manifest = read_manifest(run_dir)
        summary = read_summary(run_dir)
        require_confirmable(run_dir, manifest, summary)
        c = dict(manifest.get("config") or {})
        if not c:
            raise BadInput(f"{run_dir}: not a tpdiag compare run directory (no config in manifest.json)")
        cfg = CompareConfig.from_dict(c)
        from tpdiag.runner.launch import prestart

        prestart(cfg.model)
        if degree is not None and degree not in summary.get("degrees", {}):
            raise BadInput(f"--degree {degree}: not in this run; expected one of "
                           f"{', '.join(summary.get('degrees', {}))}")
        if fix is not None:
            (fix,) = resolve(fix)
        from tpdiag.records.lock import hold
        from tpdiag.records.run_files import write_summary

        with hold(run_dir, "confirm") as stale:
            if stale:
                console(stderr=True).print(f"note: {stale}", markup=False, soft_wrap=True)
            # the run's summary with the confirmations added: the command's one part
            summary = confirm(cfg, summary, run_dir, only_label=degree, force_fix=fix)
            write_summary(run_dir, summary)
    except TpdiagError as e:
        fail(e)
    summary["run_dir"] = run_dir
    emit_summary(summary, fmt)
    exit_for(summary, False)
