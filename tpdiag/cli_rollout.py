"""Rich rendering of `tpdiag rollout`'s summary (CLI only)."""
from __future__ import annotations

from tpdiag.cli_render import _box, _print_table


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
    if "prompt" in m:
        p = m["prompt"]
        w(f"prompt logprobs: {p['tokens']} tokens, max |diff| {p['max_abs']:.3g}, mean diff "
          f"{p['mean_diff']:+.3g}, exact {p['exact_tokens']}/{p['tokens']}", soft_wrap=True)
    pr = s["processed"]
    tag = "[bold red]processed logprobs[/]" if pr.get("detected") else "raw logprobs"
    console.print(f"{tag}: {pr['explanation']}", markup=True, soft_wrap=True)

    t = Table(title="configurations (the engine vs the trainer)", box=_box(console, box.SIMPLE_HEAD))
    for col in ("configuration", "token_mult_prob_error", "max |diff|", "mean diff", "k3 KL", "exact",
                "same bits as", "s"):
        t.add_column(col, justify="left" if col == "configuration" else "right")
    closest = set(s["closest"]["configurations"])
    for label, r in s["configurations"].items():
        if r["status"] != "ok":
            t.add_row(f"{label} ({r['status']})", "-", "-", "-", "-", "-", "", _g(r.get("seconds")))
            continue
        c = r["metrics"]
        name = label + (" *closest" if label in closest else "")
        t.add_row(name, f"{c['token_mult_prob_error']:.7f}", _g(c["max_abs"]), f"{c['mean_diff']:+.3g}",
                  _g(c["k3_kl"]), f"{c['exact_tokens']}/{c['tokens']}", r.get("same_bits_as") or "",
                  _g(r.get("seconds")))
    _print_table(console, t)
    for label, r in s["configurations"].items():
        if r["status"] != "ok":
            w(f"{label} {r['status']}: {r.get('reason', '')}", soft_wrap=True)
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
