"""One configuration type for every command: a world (compare) or a recomputation (rollout) is a
point on the axes (tp, micro_batch, mode, fix, flags, attention, padding), with one name scheme
and its parse.

The name spells the axes in a fixed order, each as one token:

    tp{N}[-{repeat}][-mb{M}][-{mode}][-{fix}][-{flags}][-{attention}][-pad{P}]

Which axes a name shows is the command's choice (`shown`), never the spelling:
- compare shows the TP degree always and every other axis only where the configuration differs
  from its reference, so a plain TP run's folders stay `tp2` and its summary keys `"2"` (the run
  directory contract), a micro-batch world `tp1-mb2`, a decode world `tp1-decode`;
- rollout shows tp, micro-batch, mode and fix always and flags, attention and padding where they
  are not their defaults (`tp1-mb4-prefill-none`, `tp1-mb4-decode-none-deterministic-eager`).
compare's summary and manifest key a configuration by its name without the leading `tp` (the
contract's `degrees: {"2": ...}`); `key()` and `parse()` convert between the two.

A repeat (compare's `--tp 1,1`, and the reference's self-baseline `base`) is not an axis: the
same configuration run again, told apart by the token after the degree.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

from tpdiag.errors import BadInput

# decode: the prompt in one call, then one token per call through the model's KV cache
# (tpdiag/runner/decode.py), forward only
MODES = ("prefill", "decode")
FLAGS = ("default", "deterministic")  # tpdiag.runner.flags.SETTINGS
ATTENTIONS = ("auto", "eager", "sdpa", "sdpa-math", "sdpa-flash", "sdpa-efficient", "sdpa-cudnn", "flex")
# auto: prefill right, decode left (generate()'s); packed: prefill only, a micro-batch's sequences
# in one row with position ids restarting per sequence (TRL's and verl's padding-free packing);
# static: decode only, left-padded, the KV cache preallocated to generate()'s max length and every
# step's keys padded to it (generate(cache_implementation="static"), TRL's cache_implementation)
# compiled: static, the decode steps through the model's torch.compile'd forward as generate() runs
# them on a GPU unless called with disable_compile=True (TRL's GRPOTrainer passes it: static there)
PADDINGS = ("auto", "left", "right", "packed", "static", "compiled")
# the paddings that decode through generate()'s StaticCache
STATIC_PADDINGS = ("static", "compiled")


def any_static(paddings) -> bool:
    """Whether any of these paddings decodes through generate()'s StaticCache."""
    return any(p in STATIC_PADDINGS for p in paddings)
TP, MICRO_BATCH, MODE, FIX, FLAG, ATTENTION, PADDING = (
    "tp", "micro_batch", "mode", "fix", "flags", "attention", "padding")
AXES = (TP, MICRO_BATCH, MODE, FIX, FLAG, ATTENTION, PADDING)
# what rollout always names; the rest where not at the default
ROLLOUT_NAMED = (TP, MICRO_BATCH, MODE, FIX)


@dataclass(frozen=True)
class Config:
    tp: int
    micro_batch: int = 0      # sequences per forward call; 0: the whole batch in one call
    mode: str = "prefill"     # MODES
    fix: str = "none"         # 'none', 'all', or fix names joined by '+'
    flags: str = "default"    # FLAGS: PyTorch's defaults or the deterministic settings
    attention: str = "auto"   # ATTENTIONS: the model's own, eager, SDPA (or one SDPA backend)
    padding: str = "auto"     # PADDINGS
    repeat: str = ""          # a rerun of the same configuration: '2', '3' ... or 'base'; '' the first

    def name(self, shown=AXES) -> str:
        """The name with the axes in `shown` (and the repeat, when there is one)."""
        out = f"tp{self.tp}"
        if self.repeat:
            out += f"-{self.repeat}"
        for axis in AXES[1:]:
            if axis in shown:
                out += "-" + _token(axis, getattr(self, axis))
        return out

    def differs(self, ref: "Config") -> tuple[str, ...]:
        """The axes this configuration differs from `ref` in, in AXES order."""
        return tuple(a for a in AXES if getattr(self, a) != getattr(ref, a))

    def compare_name(self, ref: "Config") -> str:
        """compare's folder name: the degree, and every axis that differs from the reference."""
        return self.name((TP,) + self.differs(ref))

    def compare_key(self, ref: "Config") -> str:
        """compare's summary/manifest key: its folder name without the `tp` ('2', '1-mb2')."""
        return key(self.compare_name(ref))

    def rollout_name(self) -> str:
        """rollout's name: tp, micro-batch, mode, fix, then each other axis not at its default."""
        return self.name(ROLLOUT_NAMED + tuple(a for a in AXES if a not in ROLLOUT_NAMED
                                               and getattr(self, a) != DEFAULT[a]))

    def to_dict(self, axes=AXES) -> dict:
        """The axes in `axes` (a command records the axes it has: compare tp, micro_batch and mode,
        and attention/padding where it varies them; rollout all of them)."""
        return {a: getattr(self, a) for a in AXES if a in axes}

    def with_(self, **kw) -> "Config":
        return replace(self, **kw)


DEFAULT = {f.name: f.default for f in fields(Config) if f.name in AXES[1:]}


def _token(axis: str, value) -> str:
    if axis == MICRO_BATCH:
        return f"mb{value}"
    if axis == PADDING:
        return f"pad{value}"
    return str(value)


def key(name: str) -> str:
    """'tp2' -> '2', 'tp1-mb2' -> '1-mb2' (compare's keys); a key is returned as it is."""
    return name[2:] if str(name).startswith("tp") else str(name)


def folder(label) -> str:
    """A compare key's folder name: '2' -> 'tp2', '1-mb2' -> 'tp1-mb2' (a name stays itself)."""
    label = str(label)
    return label if label.startswith("tp") else f"tp{label}"


def parse(text: str, base: Config | None = None) -> Config:
    """A name (or a compare key) back into its Config; the axes the name does not show are
    `base`'s (compare: the reference's; rollout: the defaults). BadInput when it is not a name."""
    s = str(text).strip()
    body = s[2:] if s.startswith("tp") else s
    parts = body.split("-")

    def bad(why: str):
        return BadInput(f"configuration {text!r}: {why}; expected e.g. tp2, tp1-mb2, tp1-decode or "
                        "tp1-mb4-prefill-none")

    if not parts[0].isdigit():
        raise bad(f"{parts[0]!r} is not a TP degree")
    base = base or Config(int(parts[0]))
    got = {TP: int(parts[0]), "repeat": ""}
    i = 1
    if i < len(parts) and (parts[i].isdigit() or parts[i] == "base"):
        got["repeat"] = parts[i]
        i += 1
    if i < len(parts) and parts[i].startswith("mb") and parts[i][2:].isdigit():
        got[MICRO_BATCH] = int(parts[i][2:])
        i += 1
    if i < len(parts) and parts[i] in MODES:
        got[MODE] = parts[i]
        i += 1
    rest = parts[i:]
    # from the end: padding, attention (its choices hold '-'), flags; what is left is the fix
    if rest and rest[-1].startswith("pad") and rest[-1][3:] in PADDINGS:
        got[PADDING] = rest.pop()[3:]
    for n in (2, 1):
        if len(rest) >= n and "-".join(rest[-n:]) in ATTENTIONS:
            got[ATTENTION] = "-".join(rest[-n:])
            del rest[-n:]
            break
    if rest and rest[-1] in FLAGS:
        got[FLAG] = rest.pop()
    if rest:
        fix = "-".join(rest)
        if not all(p and all(c.isalnum() or c == "-" for c in p) for p in fix.split("+")):
            raise bad(f"{fix!r} is not a fix ('none', 'all' or fix names joined by '+')")
        got[FIX] = fix
    return replace(base, **got)
