"""Report figures as PNG data URIs (matplotlib Agg, imported on first use).

Figures are built on `matplotlib.figure.Figure` directly, not pyplot: no global state, no
backend switch that could leak into a caller that imported pyplot itself. Every figure caps
its labels so a model with hundreds of modules still gives a readable picture.
"""
from __future__ import annotations

import base64
import io
import math

MAX_TICK_LABELS = 48
PHASE_COLORS = {"init": "#f2f2f2", "forward": "#e8f0fb", "loss": "#fbeee6", "backward": "#eaf6ea",
                "optimizer": "#f4ecf8"}


def _figure(w: float, h: float, rows: int = 1, sharex: bool = False):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(w, h), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, 1, sharex=sharex, squeeze=False)[:, 0]
    return fig, axes


def _png(fig) -> str:
    buf = io.BytesIO()
    # No Software/date metadata: the same run directory renders to the same bytes.
    fig.savefig(buf, format="png", metadata={"Software": None})
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _colors(n: int) -> list:
    from matplotlib import colormaps

    cmap = colormaps["tab10"]
    return [cmap(i % 10) for i in range(n)]


def _phase_bands(ax, phases: list[str], label: bool) -> None:
    """Shade contiguous runs of one phase so execution order reads as forward -> backward -> step."""
    start = 0
    for i in range(1, len(phases) + 1):
        if i == len(phases) or phases[i] != phases[start]:
            ax.axvspan(start - 0.5, i - 0.5, color=PHASE_COLORS.get(phases[start], "#f7f7f7"), zorder=0, lw=0)
            if label and i - start >= max(3, len(phases) // 40):
                ax.text((start + i - 1) / 2, 1.0, phases[start], transform=ax.get_xaxis_transform(),
                        ha="center", va="bottom", fontsize=8, color="#555")
            start = i


def divergence_by_record(series: dict[str, dict]) -> str | None:
    """series: {label: {"phases": [...], "ulp": [...], "abs": [...], "first": pos|None, "first_name": str}}."""
    if not series:
        return None
    fig, (ax_u, ax_a) = _figure(12, 6.2, rows=2, sharex=True)
    first_phases = next(iter(series.values()))["phases"]
    _phase_bands(ax_u, first_phases, label=True)
    _phase_bands(ax_a, first_phases, label=False)
    drawn = {"ulp": 0, "abs": 0}
    for color, (label, s) in zip(_colors(len(series)), series.items()):
        # The first divergence is named in the legend, not annotated: with many degrees the first
        # divergences sit close together and annotations would overprint each other.
        name = f"TP={label}" + (f" (first: {s['first_name']})" if s["first"] is not None else "")
        for ax, key in ((ax_u, "ulp"), (ax_a, "abs")):
            # A non-finite record (infinite max_abs: NaN or Inf at one side) has no place on a log
            # axis; the verdict names it.
            ys = [y if y is not None and math.isfinite(y) and y > 0 else None for y in s[key]]
            xs_div = [i for i, y in enumerate(ys) if y]
            drawn[key] += len(xs_div)
            ax.plot(xs_div, [ys[i] for i in xs_div], ".", ms=3.5, color=color, label=name)
            if s["first"] is not None and ys[s["first"]]:
                ax.plot([s["first"]], [ys[s["first"]]], marker="*", ms=15, color=color, mec="#c00", mew=1.2,
                        zorder=5, ls="none")
            if s["first"] is not None:
                ax.axvline(s["first"], color=color, ls="--", lw=0.8)
    for ax, key in ((ax_u, "ulp"), (ax_a, "abs")):
        if drawn[key]:  # log of nothing is an error in matplotlib, and there is nothing to scale
            ax.set_yscale("log")
    ax_u.set_ylabel("max ULP (log)")
    ax_a.set_ylabel("max |difference| (log)")
    ax_a.set_xlabel("record, in execution order (bitwise-equal records are not drawn)")
    handles, names = ax_u.get_legend_handles_labels()
    if handles:
        fig.legend(handles, names, loc="outside upper center", fontsize=8, ncol=min(3, len(series)), markerscale=2)
    if not drawn:
        ax_u.text(0.5, 0.5, "every record is bitwise equal", transform=ax_u.transAxes, ha="center")
    return _png(fig)


def module_heatmap(labels: list[str], modules: list[str], values: list[list[float | None]],
                   first: dict[str, str | None]) -> str | None:
    """values[i][j]: max ULP of module j at degree labels[i]; 0 is bitwise, None no record."""
    if not modules or not labels:
        return None
    import numpy as np
    from matplotlib import colormaps
    from matplotlib.colors import ListedColormap, LogNorm

    arr = np.array([[np.nan if v is None else float(v) for v in row] for row in values])
    width = min(13.0, max(6.0, 0.22 * len(modules) + 2))
    step = max(1, math.ceil(len(modules) / MAX_TICK_LABELS))
    ticks = list(range(0, len(modules), step))
    size = 7 if len(ticks) > 24 else 8
    # the module names stand rotated under the cells: the figure is as tall as the longest one
    # (about 0.6 em a character) on top of the rows, or constrained layout collapses the axes -
    # an hf: model's 'model.layers.0.self_attn.o_proj' at one degree did (matplotlib warned)
    names = max(len(modules[j]) for j in ticks) * size * 0.62 / 72
    fig, (ax,) = _figure(width, 1.1 + 0.42 * len(labels) + names)
    pos = arr[arr > 0]
    norm = LogNorm(vmin=max(1.0, float(pos.min())) if pos.size else 1.0,
                   vmax=max(2.0, float(pos.max())) if pos.size else 2.0)
    masked = np.ma.masked_where(~(arr > 0), arr)
    # Two layers: a background telling "bitwise" from "no record", then the log-scaled ULP on top.
    ax.imshow(np.where(np.isnan(arr), 0.0, 1.0), cmap=ListedColormap(["#d0d0d0", "#eef6ee"]), aspect="auto",
              vmin=0, vmax=1, interpolation="nearest")
    im = ax.imshow(masked, cmap=colormaps["viridis"], norm=norm, aspect="auto", interpolation="nearest")
    fig.colorbar(im, ax=ax, label="max ULP (log)", pad=0.01)
    ax.set_yticks(range(len(labels)), [f"TP={lab}" for lab in labels])
    ax.set_xticks(ticks, [modules[j] for j in ticks], rotation=90, fontsize=size)
    if step > 1:
        ax.set_xlabel(f"{len(modules)} modules in execution order (every {step}th labelled)")
    from matplotlib.patches import Rectangle

    for i, lab in enumerate(labels):
        if first.get(lab) in modules:
            j = modules.index(first[lab])
            ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, ec="#c00", lw=2))
    return _png(fig)


def ulp_histogram(hists: dict[str, dict], names: dict[str, str]) -> str | None:
    """hists: {label: {"counts": [...]}} in power-of-two buckets (see evidence.ulp_histogram)."""
    hists = {k: v for k, v in hists.items() if v}
    if not hists:
        return None
    import numpy as np

    n = max(len(h["counts"]) for h in hists.values())
    fig, (ax,) = _figure(10, 3.6)
    width = 0.8 / len(hists)
    for k, (color, (label, h)) in enumerate(zip(_colors(len(hists)), hists.items())):
        counts = np.array(h["counts"] + [0] * (n - len(h["counts"])), dtype=float)
        xs = np.arange(n) + (k - (len(hists) - 1) / 2) * width
        ax.bar(xs, np.where(counts > 0, counts, np.nan), width=width, color=color,
               label=f"TP={label}: {names.get(label, '')}")
    ax.set_yscale("log")
    step = max(1, math.ceil(n / 32))
    ax.set_xticks(range(0, n, step), ["0" if i == 0 else f"2^{i - 1}" for i in range(0, n, step)], fontsize=8)
    ax.set_xlabel("ULP distance per element (bucket [2^k, 2^(k+1)); 0 = bitwise equal element)")
    ax.set_ylabel("elements (log)")
    ax.legend(fontsize=8)
    return _png(fig)


def logprob_tokens(series: dict[str, dict], tmpe: dict[str, float | None]) -> str | None:
    """series: {label: {"diff": [...], "mask": [...]|None, "seq_len": int|None}} (logprob TP=N - TP=ref)."""
    series = {k: v for k, v in series.items() if v}
    if not series:
        return None
    fig, (ax,) = _figure(12, 3.6)
    width = 0.6 / len(series)
    for k, (color, (label, s)) in enumerate(zip(_colors(len(series)), series.items())):
        d, mask = s["diff"], s["mask"] or [True] * len(s["diff"])
        # Stems side by side per token: lines joining tokens would suggest a trend that is not there.
        xs = [i + (k - (len(series) - 1) / 2) * width for i, m in enumerate(mask) if m]
        ys = [d[i] for i, m in enumerate(mask) if m]
        err = tmpe.get(label)
        lab = f"TP={label}" + (f" (token_mult_prob_error {err:.7f})" if err is not None else "")
        ax.vlines(xs, 0, ys, color=color, lw=1.2)
        ax.plot(xs, ys, "o", ms=3, color=color, label=lab)
    s0 = next(iter(series.values()))
    n = len(s0["diff"])
    if s0["seq_len"]:
        for b in range(s0["seq_len"], n, s0["seq_len"]):
            ax.axvline(b - 0.5, color="#999", lw=0.8, ls=":")
    if s0["mask"]:
        ign = [i for i, m in enumerate(s0["mask"]) if not m]
        ax.plot(ign, [0] * len(ign), "x", color="#aaa", ms=4, label="ignored (label -100)")
    ax.axhline(0, color="#444", lw=0.6)
    ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    ax.set_xlabel("token (batch rows separated by dotted lines)")
    ax.set_ylabel("logprob TP=N - reference (nats)")
    fig.legend(fontsize=8, loc="outside upper center", ncol=min(4, len(series) + 1))
    return _png(fig)


def per_step(steps: list[int], series: dict[str, dict[str, list[float | None]]], ref: str) -> str | None:
    """series: {"loss": {"TP=1": [...], "TP=2": [...]}, "grad norm": {...}}; drawn only for 2+ steps.

    Values at different degrees overlap at plotting resolution, so a last panel shows the
    difference from the reference on a log scale; bitwise-equal steps have no point there.
    """
    series = {k: v for k, v in series.items() if v}
    if len(steps) < 2 or not series:
        return None
    from matplotlib.ticker import MaxNLocator

    fig, axes = _figure(10, 2.3 * (len(series) + 1), rows=len(series) + 1, sharex=True)
    colors = _colors(max(len(v) for v in series.values()))
    for ax, (name, lines) in zip(axes, series.items()):
        for color, (label, ys) in zip(colors, lines.items()):
            ax.plot(steps, [float("nan") if y is None else y for y in ys], "o-", ms=3, color=color, label=label)
        ax.set_ylabel(name)
        ax.legend(fontsize=8)
    diff_ax = axes[-1]
    for (name, lines), marker in zip(series.items(), "os^v"):
        base = lines.get(ref)
        for color, (label, ys) in zip(colors, lines.items()):
            if label == ref or base is None:
                continue
            d = [abs(y - b) if y is not None and b is not None and y != b else float("nan") for y, b in zip(ys, base)]
            diff_ax.plot(steps, d, marker=marker, ls="-", ms=4, color=color, label=f"{name} {label}")
    diff_ax.set_yscale("log")
    diff_ax.set_ylabel(f"|value - {ref}|")
    if diff_ax.lines:
        diff_ax.legend(fontsize=8)
    diff_ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    diff_ax.set_xlabel("optimizer step")
    return _png(fig)


def mitigation_matrix(matrix: dict) -> str | None:
    """Logprob max |difference| per variant x degree (compare --variants), log scale.

    A bitwise cell has nothing to place on a log axis: it is drawn as a green check at the floor
    of the axis; a failed cell as a red cross there. The reference degree is left out (it is each
    variant's own reference)."""
    labels = [lab for lab in matrix.get("degrees", []) if lab != matrix.get("reference")]
    names = list(matrix.get("variants", []))
    cells = matrix.get("cells", {})
    if not labels or not names:
        return None
    vals = [[(cells.get(n, {}).get(lab) or {}) for lab in labels] for n in names]
    pos = [c["logprob_max_abs"] for row in vals for c in row
           if c.get("status") in ("bitwise", "divergent") and (c.get("logprob_max_abs") or 0) > 0]
    floor = min(pos) / 20 if pos else 1e-9
    top = max(pos) * 5 if pos else 1e-6
    fig, (ax,) = _figure(min(12.0, max(7.0, 2.5 + 0.45 * len(labels) * len(names))), 4.0)
    width = 0.8 / len(names)
    for k, (color, name, row) in enumerate(zip(_colors(len(names)), names, vals)):
        xs = [i + (k - (len(names) - 1) / 2) * width for i in range(len(labels))]
        ys = [c.get("logprob_max_abs") if c.get("status") == "divergent" and (c.get("logprob_max_abs") or 0) > 0
              else float("nan") for c in row]
        ax.bar(xs, [y - floor if y == y else 0.0 for y in ys], bottom=floor, width=width, color=color, label=name)
        for x, c in zip(xs, row):
            st = c.get("status")
            if st in ("bitwise", "divergent") and not (c.get("logprob_max_abs") or 0) > 0:
                # nothing to draw on a log axis: say it in words, in the variant's colour
                text, tcolor = ("bitwise" if st == "bitwise" else "logprobs equal"), color
            elif st in ("bitwise", "divergent"):
                continue
            else:
                text, tcolor = "failed", "#c0262d"
            ax.text(x, floor * 1.3, text, rotation=90, ha="center", va="bottom", fontsize=8,
                    color=tcolor, fontweight="bold")
    ax.set_yscale("log")
    ax.set_ylim(floor, top)
    ax.set_xlim(-0.5, len(labels) - 0.5)
    ax.set_xticks(range(len(labels)), [f"TP={lab}" for lab in labels])
    ax.set_ylabel("logprob max |difference| (log)")
    ax.set_xlabel(f"degree (each variant against its own TP={matrix.get('reference')})")
    ax.legend(fontsize=8, ncol=min(3, len(names)))
    return _png(fig)
