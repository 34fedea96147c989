"""Help strings for the CLI options, built from the tables the code validates against, so
`--help` cannot list a choice the code refuses or miss one it accepts. Light imports only:
`import tpdiag.cli` must not pull in torch."""
from __future__ import annotations

import click
import typer.core


def _wrap(text: str, width: int, indent: str = "", subsequent: str = "") -> str:
    """Paragraphs (blank-line separated) filled to `width`, breaking only at spaces: a choice
    like tp-invariant-linear or a path stays whole on one line, even past the width."""
    import textwrap

    paras = [" ".join(p.split()) for p in text.split("\n\n") if p.strip()]
    return "\n\n".join(textwrap.fill(p, width, initial_indent=indent, subsequent_indent=subsequent,
                                     break_long_words=False, break_on_hyphens=False) for p in paras)


class _Formatter(click.HelpFormatter):
    def write_text(self, text: str) -> None:
        pad = " " * self.current_indent
        self.write(_wrap(text, max(self.width, 11), pad, pad) + "\n")

    def write_dl(self, rows, col_max: int = 30, col_spacing: int = 2) -> None:
        rows = list(rows)
        first_col = min(max((click.formatting.term_len(r[0]) for r in rows), default=0), col_max) + col_spacing
        pad = " " * self.current_indent
        for first, second in rows:
            self.write(pad + first)
            if not second:
                self.write("\n")
                continue
            if click.formatting.term_len(first) <= first_col - col_spacing:
                self.write(" " * (first_col - click.formatting.term_len(first)))
            else:
                self.write("\n" + " " * (first_col + self.current_indent))
            lines = _wrap(second, max(self.width - first_col - 2, 10)).splitlines() or [""]
            self.write(lines[0] + "\n")
            for line in lines[1:]:
                self.write(" " * (first_col + self.current_indent) + line + "\n")


class _Context(click.Context):
    formatter_class = _Formatter


class Group(typer.core.TyperGroup):
    """Help that never cuts a word: each command's whole first sentence in the command list
    (click cuts it to the width left beside the names, ending in '...'), and text wrapped
    only at spaces (click also breaks at hyphens and inside long words)."""

    context_class = _Context

    def get_command(self, ctx, name):
        cmd = super().get_command(ctx, name)
        if cmd is not None:
            cmd.context_class = _Context
        return cmd

    def format_commands(self, ctx, formatter) -> None:
        rows = []
        for name in self.list_commands(ctx):
            cmd = self.get_command(ctx, name)
            if cmd is not None and not cmd.hidden:
                rows.append((name, cmd.get_short_help_str(limit=10_000)))
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


def help_width() -> dict:
    """click's context settings: on a terminal wrap at its width (click's default stops at 80);
    piped, a width no paragraph reaches, so each stays on one line."""
    import shutil
    import sys

    if sys.stdout.isatty():
        cols = shutil.get_terminal_size().columns
        return {"max_content_width": max(cols, 50)}
    return {"terminal_width": 100_000, "max_content_width": 100_000}


def _bar(xs) -> str:
    return " | ".join(xs)


def model() -> str:
    from tpdiag.models.presets import PRESETS

    return (f"{_bar(PRESETS)} (built-in presets) | hf:DIR (a local transformers model directory) | "
            "py:FILE.py:FUNC (your own model and plan, a tpdiag.Target); see docs/models.md")


def variant() -> str:
    from tpdiag.models.plans import HF_VARIANTS, VARIANTS

    return (f"plan variant: built-in models {_bar(VARIANTS)} (stable: NeMo RL's out-projections; "
            f"sp: sequence parallelism); hf: models {_bar(HF_VARIANTS)} (sharded-head: the LM head's "
            "logits stay vocab shards, with a vocab-parallel loss; docs/models.md)")


def fix_names() -> list[str]:
    from tpdiag.fixes.registry import catalogue

    return list(catalogue())


def fix() -> str:
    return ("none (default) | auto (fix and rerun until nothing diverges) | all | NAME[,NAME] with NAME one of "
            f"{', '.join(fix_names())} (tpdiag fixes; docs/causes.md)")


def variants() -> str:
    from tpdiag.models.plans import HF_VARIANTS, VARIANTS

    return (f"mitigation matrix: run each variant at every degree; a variant is a plan ({_bar(VARIANTS)}; "
            f"hf: models {_bar(HF_VARIANTS)}), "
            "fix:NAME, fix:all, or PLAN+fix:NAME, e.g. stock,stable,fix:all,stable+fix:tp-invariant-linear")


def choice(table: str) -> str:
    from tpdiag import config

    return _bar(getattr(config, table))


def micro_batch() -> str:
    return ("sequences per forward call, e.g. 4,1: the same global batch in micro-batches of these sizes "
            "(gradients accumulated, one optimizer step); the first is the reference's")


def mode() -> str:
    from tpdiag.base.points import MODES

    return (f"how the sequences go through the model, the first the reference: {_bar(MODES)} (decode: "
            "the prompt in one call, then one token per call through the KV cache; forward only, "
            "whatever --backward says; docs/decode.md)")


def grid() -> str:
    return ("compare every combination of --tp, --micro-batch, --mode and --attention (default: one axis "
            "at a time)")


def attention() -> str:
    from tpdiag.base.configs import ATTENTIONS

    return (f"attention implementations to compare, the first the reference's: {_bar(ATTENTIONS)} (auto: the "
            "model's own; sdpa-BACKEND: SDPA restricted to one backend; eager alone: every configuration eager, an "
            "hf: model as attn_implementation=\"eager\" loads it; eager beside another is refused, with the reason: "
            "it gives the layers other inputs - tpdiag rollout --attention compares it; flex: refused, rollout's only; docs/rl.md)")


PADDING = ("padding sides as an axis: refused by compare (its sequences fill --seq-len and decode's prompts "
           "are one length: there is no padding to place); tpdiag rollout --padding compares them")


def axes(micro_batch: str | None, mode: str | None, grid: bool, attention: str | None = None,
         padding: str | None = None) -> dict:
    """compare's CompareConfig keywords for the axes besides TP."""
    from tpdiag.base.points import parse_micro_batches, parse_modes

    out = {"micro_batches": parse_micro_batches(micro_batch), "modes": parse_modes(mode), "grid": grid}
    if attention is not None:
        from tpdiag.runner.attention import parse

        out["attentions"] = parse(attention)
    if padding is not None:
        from tpdiag.rollout.options import parse_padding

        out["paddings"] = parse_padding(padding)
    return out


VERBOSE = ("after the verdict, where the time went: setup, each world, the reference rerun, the diff, "
           "the second pass, each confirmation rerun, and within the worlds model build, float64 "
           "re-execution and Triton compiles (manifest.json time_breakdown)")
LAYERS = ("run only the model's first N decoder layers, with its real embedding, final norm and head "
          "(the same weights; hf: per-layer config lists cut to match): a model whose reference does not "
          "fit one GPU; 0: every layer")

ANCHOR = ("with --steps N (on by default): start each later step of a TP > 1 world from the reference's state "
          "(parameters, AdamW's moments, buffers) cut to its shards, so step k is judged without the updates' "
          "drift, as step 0 is (docs/causes.md, Later steps); --no-anchor: each side trains on its own, and a "
          "later step's records move by the drift too, judged by magnitude where no float64 re-execution "
          "from this side's own inputs applies")

# the trainer's logprob recipe (runner/recipe.py): rollout's and compare's, one wording
LOGPROB = ("the trainer's logprob recipe, every configuration's: log-softmax (logits.float().log_softmax(-1) "
           "gathered at the token), logsumexp (x = logits.float(); x.gather(-1, ids) - x.logsumexp(-1): TRL's "
           "selective_log_softmax and verl's v2 for float32 logits, OpenRLHF), model-dtype (log_softmax in the "
           "logits' own dtype, e.g. bf16: TRL's and verl's v2 for bf16 logits); docs/rl.md")
TRAINER_TEMPERATURE = ("the trainer divides its logits by this temperature before the logprob (1: no division); "
                       "where: --temperature-in")
COMPILED = ("the trainer's logprob recipe (--logprob, its temperature) under torch.compile(dynamic=True), as one "
            "function from the logits, as TRL's and others' decorated logprob functions: inductor's fused kernel "
            "rounds otherwise than eager (docs/rl.md)")
TEMPERATURE_IN = ("where the trainer divides by --trainer-temperature: float32 (logits.float() / T) or model "
                  "((logits / T).float(): in the logits' own dtype, as TRL's GRPO and verl divide bf16 logits)")
