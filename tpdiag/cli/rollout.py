"""`tpdiag rollout`: its typed command function (registered by cli.py) and the rendering of its
summary (CLI only)."""
from __future__ import annotations

import sys
from typing import Annotated

import typer

from tpdiag.cli import options as H
from tpdiag.cli.common import DEBUG, QUIET_HELP, Debug, Format, check_format, console, reported, print_json
from tpdiag.cli.plain_table import _box, _print_table


def rollout(
    file: Annotated[str, typer.Argument(help="the engine's logprobs: a vLLM or SGLang response (JSON or "
                                             "JSON lines), or tpdiag's JSONL of token ids (docs/rl.md)")],
    model: Annotated[str, typer.Option(help=H.model())] = "tiny-llama",
    tp: Annotated[str, typer.Option(help="TP degrees to try: 1 in this process, each other in a world of its "
                                         "own (gloo on cpu, NCCL on cuda)")] = "1",
    micro_batch: Annotated[str, typer.Option(help="micro-batch sizes to try: sequences per forward call")] = "8,1",
    mode: Annotated[str, typer.Option(help="prefill (one call per micro-batch) and/or decode (prompt, then one "
                                           "token per step through the KV cache: hf: models, the built-in presets, "
                                           "a py: model with new_kv_cache(); docs/decode.md)")] = "prefill,decode",
    fix: Annotated[str, typer.Option(help="fix sets to try, comma-separated: none, all, or NAME+NAME "
                                          f"({', '.join(H.fix_names())})")] = "none,all",
    flags: Annotated[str, typer.Option(help="backend flags to try: default (PyTorch's own, what engines and "
                                            "trainers run) and/or deterministic (deterministic algorithms, no "
                                            "TF32, no reduced-precision reductions); docs/rl.md")] = "default",
    attention: Annotated[str, typer.Option(help="attention implementations to try: auto (the model's own), eager, "
                                                "sdpa, sdpa-math, sdpa-flash, sdpa-efficient, sdpa-cudnn, flex "
                                                "(attn_implementation=\"flex_attention\"; hf: models)")] = "auto",
    padding: Annotated[str, typer.Option(help="padding sides to try: auto (prefill right, decode left as "
                                              "generate()), left, right, packed (prefill: a micro-batch's "
                                              "sequences in one row, position ids restarting, as TRL/verl pack "
                                              "them; hf: models), static (decode through a KV cache preallocated to "
                                              "the max length, generate(cache_implementation=\"static\", "
                                              "disable_compile=True) as TRL runs it; hf: models), compiled "
                                              "(static, its decode steps torch.compile'd as generate() runs them "
                                              "on a GPU by default)")] = "auto",
    sampling: Annotated[str, typer.Option(help="the engine's generate() sampling settings when its logprobs are "
                                               "its processed scores (output_scores): comma-separated NAME=VALUE of "
                                               "temperature, top_k, top_p, min_p, typical_p, repetition_penalty, "
                                               "no_repeat_ngram_size, min_new_tokens, eos_token_id, bad_words_ids, "
                                               "sequence_bias (JSON lists), forced_eos_token_id (with "
                                               "max_new_tokens); the trainer's logits go through generate()'s "
                                               "own processors first (hf: models; docs/rl.md). none: raw "
                                               "logprobs")] = "none",
    max_cache_len: Annotated[int, typer.Option(help="--padding static's KV cache length: generate()'s max_length - 1 "
                                                    "(the batch's longest prompt + max_new_tokens - 1), or its "
                                                    "generation_config.max_cache_len, or a longer earlier call's "
                                                    "on the same model (transformers keeps the longest); 0: the "
                                                    "longest prompt + max_new_tokens - 1")] = 0,
    max_new_tokens: Annotated[int, typer.Option(help="generate()'s max_new_tokens, which sets --padding static's "
                                                     "KV cache length (each micro-batch's longest prompt + it - 1); "
                                                     "0: --sampling's, else the rollout's most generated tokens "
                                                     "where one ran out, else the checkpoint's generation_config "
                                                     "max_new_tokens (or max_length), else that most")] = 0,
    logprob: Annotated[str, typer.Option(help=H.LOGPROB)] = "log-softmax",
    trainer_temperature: Annotated[float, typer.Option(help=H.TRAINER_TEMPERATURE)] = 1.0,
    temperature_in: Annotated[str, typer.Option(help=H.TEMPERATURE_IN)] = "float32",
    compiled: Annotated[bool, typer.Option("--compiled", help=H.COMPILED)] = False,
    dtype: Annotated[str, typer.Option(help=H.choice("DTYPES"))] = "float32",
    device: Annotated[str, typer.Option(help="cpu | cuda | auto (cuda when there is one)")] = "auto",
    seed: Annotated[int, typer.Option(help="seed of the random init when the model has no weights")] = 1234,
    top: Annotated[int, typer.Option(help="worst tokens to list (0: none)")] = 10,
    timeout: Annotated[float, typer.Option(help="seconds per TP > 1 world")] = 300.0,
    jobs: Annotated[str, typer.Option(help="concurrent worlds per TP degree, a configuration's micro-batches "
                                           "split between them (the same bits): auto (1 on cpu; on cuda one process "
                                           "per 3 CPU cores of each GPU, at most 6 a GPU, shared between the "
                                           "degrees by their work, spread over the GPUs) or N (every degree); "
                                           "1: one process per degree, one after another")] = "auto",
    fmt: Format = "text",
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help=QUIET_HELP)] = False,
    debug: Debug = False,
) -> None:
    """Compare a rollout engine's per-token logprobs with the trainer's, recomputed for the same tokens.

    FILE: vLLM (logprobs.content / prompt_logprobs with token ids), SGLang (meta_info's
    input/output_token_logprobs) or tpdiag's JSONL; format in docs/rl.md."""
    DEBUG["on"] = debug
    with reported():
        from tpdiag.runner.start_context import refuse_rerun

        refuse_rerun(starts=False)  # a rank re-running a script's unguarded call to this command leaves at once
        from tpdiag.config import DTYPES, parse_choice
        from tpdiag.runner import attention as attn
        from tpdiag.runner import recipe as trainer_recipe
        from tpdiag.rollout import sampling as rollout_sampling
        from tpdiag.rollout.run import (RolloutConfig, parse_fixes, parse_ints, parse_jobs, parse_modes,
                                        parse_padding, run_rollout)
        from tpdiag.runner import flags as backend_flags

        fmt = check_format(fmt)
        if top < 0:  # was read as 0 without a word: a user asking for -1 meant something else
            from tpdiag.errors import BadInput

            raise BadInput(f"--top {top}: must be >= 0 (the number of worst tokens to list; 0 lists none)")
        dev = parse_choice("--device", device, ("auto", "cpu", "cuda"))
        if dev == "auto":
            import torch

            dev = "cuda" if torch.cuda.is_available() else "cpu"
        rc = RolloutConfig(file=file, model=model, tp=parse_ints("--tp", tp),
                           micro_batch=parse_ints("--micro-batch", micro_batch), modes=parse_modes(mode),
                           fixes=parse_fixes(fix), dtype=parse_choice("--dtype", dtype, DTYPES),
                           device=dev, seed=seed, top=top, timeout=timeout,
                           flags=backend_flags.parse("--flags", flags), attention=attn.parse(attention),
                           padding=parse_padding(padding), jobs=parse_jobs(jobs),
                           sampling=rollout_sampling.parse(sampling), max_cache_len=max_cache_len,
                           max_new_tokens=max_new_tokens,
                           recipe=trainer_recipe.parse(logprob, trainer_temperature, temperature_in, compiled))
        from tpdiag.models.spec import parse_spec

        parse_spec(model)
        on_status = None
        if fmt == "text" and not quiet and sys.stderr.isatty():
            err = console(stderr=True)
            on_status = lambda label, st: err.print(f"  {label}: {st}")  # noqa: E731
        summary = run_rollout(rc, on_status)
    if fmt == "json":
        print_json(summary)
    else:
        rollout_report(console(), summary)
    failed = [k for k, r in summary["configurations"].items() if r.get("status") == "failed"]
    if failed:
        # DESIGN.md: a world failed -> 2. The report above stands for the configurations that ran;
        # the ones that failed gave no bits, so the run as asked for is incomplete
        from rich.markup import escape

        n = len(failed)
        console(stderr=True).print(
            f"[bold red]inconclusive:[/] {n} configuration{'s' if n != 1 else ''} failed and gave no logprobs "
            f"({escape(', '.join(failed[:4]))}{', ...' if n > 4 else ''}; why: in the report): the verdict "
            "covers only those that ran (exit 2)", markup=True, soft_wrap=True)
        raise typer.Exit(2)



def _g(x, spec=".3g"):
    return "-" if x is None else format(x, spec)


def rollout_report(console, s: dict) -> None:
    from rich import box
    from rich.table import Table

    m = s["metrics"]
    w = console.print
    w(f"read: {s['file']} ({s['format']}): {s['sequences']} sequences, {s['generated_tokens']} "
      f"generated tokens", soft_wrap=True)
    w(f"trainer: {s['model']} {s['dtype']} on {s['device']}; reference configuration {s['reference']}",
      soft_wrap=True)
    w(f"token_mult_prob_error {m['token_mult_prob_error']:.7f}   max |diff| {m['max_abs']:.3g}   "
      f"mean diff {m['mean_diff']:+.3g}   k3 KL {m['k3_kl']:.3g}   exact {m['exact_tokens']}/{m['tokens']}",
      soft_wrap=True)
    far = m.get("beyond_range")
    if far:
        first = "; ".join(f"{x['where']} position {x['position']} (engine {x['engine']:.6g}, trainer {x['trainer']:.6g})"
                          for x in far["first"][:3])
        n = far["tokens"]
        w(f"beyond range: {n} generated token{'s have' if n != 1 else ' has'} a logprob below {far['floor']:.2f} (float32's "
          f"smallest probability); no float32 engine or trainer sampled them, and they dominate every metric "
          f"above: {first}", soft_wrap=True)
    if "prompt" in m:
        p = m["prompt"]
        w(f"prompt logprobs: {p['tokens']} tokens, max |diff| {p['max_abs']:.3g}, mean diff "
          f"{p['mean_diff']:+.3g}, exact {p['exact_tokens']}/{p['tokens']}", soft_wrap=True)
    for f in (s.get("flags") or {}).values():
        w(f["line"], soft_wrap=True)
    if s.get("sdpa_ran"):
        w(f"SDPA backend that ran: {s['sdpa_ran']}", soft_wrap=True)
    rec = s.get("logprob_recipe") or {}
    if rec and (rec["name"] != "log-softmax" or rec["temperature"] != 1.0):
        w(f"logprob recipe (--logprob): {rec['formula']}, in every configuration", soft_wrap=True)
    if s.get("sampling"):
        w(f"sampling: the trainer's logits of each generated token go through generate()'s processors before "
          f"the logprob: {s['sampling']['processors']}", soft_wrap=True)
    pr = s["processed"]
    # detected None: not judged - "raw" would claim what was not checked
    tag = {True: "[bold red]processed logprobs[/]",
           False: "logprobs as --sampling processes them" if s.get("sampling") else "raw logprobs"}.get(
        pr.get("detected"),
                                                                              "raw or processed logprobs")
    console.print(f"{tag}: {pr['explanation']}", markup=True, soft_wrap=True)

    t = Table(title="configurations (the engine vs the trainer)", box=_box(console, box.SIMPLE_HEAD))
    for col in ("configuration", "token_mult_prob_error", "max |diff|", "mean diff", "k3 KL", "exact",
                "same bits as", "s"):
        t.add_column(col, justify="left" if col == "configuration" else "right")
    closest = set(s["closest"]["configurations"])
    mark = " *reproduces" if s["closest"].get("reproduced") else " *nearest"
    for label, r in s["configurations"].items():
        if r["status"] != "ok":
            t.add_row(f"{label} ({r['status']})", "-", "-", "-", "-", "-", "", _g(r.get("seconds")))
            continue
        c = r["metrics"]
        name = label + (mark if label in closest else "")
        t.add_row(name, f"{c['token_mult_prob_error']:.7f}", _g(c["max_abs"]), f"{c['mean_diff']:+.3g}",
                  _g(c["k3_kl"]), f"{c['exact_tokens']}/{c['tokens']}"
                  + (f" +{c['filtered_out']['tokens']} cut" if c.get("filtered_out") else ""),
                  r.get("same_bits_as") or "",
                  _g(r.get("seconds")))
    _print_table(console, t)
    # one line per reason: an attention implementation the model lacks makes every configuration
    # of that value unavailable with transformers' same paragraph (8 lines of it at --tp 1,2)
    why: dict[tuple, list[str]] = {}
    for label, r in s["configurations"].items():
        if r["status"] != "ok":
            why.setdefault((r["status"], r.get("reason", "")), []).append(label)
    for (status, reason), labels in why.items():
        w(f"{', '.join(labels)} {status}: {reason}", soft_wrap=True)
    for label, r in s["configurations"].items():
        cut = (r.get("metrics") or {}).get("filtered_out")
        if cut:  # its numbers are over the tokens it kept: say which it lost
            w(f"{label}: {cut['line']}; its numbers are over the other tokens", soft_wrap=True)
    if "explanation" in s["closest"]:
        w(f"closest to the engine: {s['closest']['explanation']}", soft_wrap=True)
    else:  # a summary of an older tpdiag
        w(f"closest to the engine: {', '.join(s['closest']['configurations'])} (mean |diff| "
          f"{s['closest']['mean_abs']:.3g}, max {s['closest']['max_abs']:.3g}, exact "
          f"{s['closest']['exact_tokens']}/{s['generated_tokens']})", soft_wrap=True)

    if s["worst_tokens"]:
        t = Table(title=f"worst tokens ({s['reference']})",
                  box=_box(console, box.SIMPLE_HEAD))
        for col in ("seq", "pos", "token", "engine", "trainer", "diff", "top-2 margin", "rank", ""):
            t.add_column(col, justify="right")
        for x in s["worst_tokens"]:
            t.add_row(str(x["sequence"]), str(x["position"]), str(x["token_id"]), f"{x['engine']:.6f}",
                      f"{x['trainer']:.6f}", f"{x['diff']:+.3g}", _g(x["top2_margin"]),
                      _g(x["trainer_rank"], "d"), "near-tie" if x["near_tie"] else "")
        _print_table(console, t)
    for n in s.get("notes", []):
        w(f"note: {n}", soft_wrap=True)
    if s.get("what_to_do"):  # a summary of an older tpdiag has none
        from rich.markup import escape

        console.print(f"[bold]what to do:[/] {escape(s['what_to_do']['line'])}", soft_wrap=True)
