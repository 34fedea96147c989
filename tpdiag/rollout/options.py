"""`tpdiag rollout`'s option values parsed: each a tuple of the values to try (or --jobs' count);
bad input is one BadInput naming the option."""
from __future__ import annotations

from tpdiag.base.points import no_repeat
from tpdiag.errors import BadInput
from tpdiag.rollout.compute import MODES


def parse_ints(option: str, text: str) -> tuple[int, ...]:
    parts = [p.strip() for p in str(text).split(",")]
    try:
        out = tuple(int(p) for p in parts)
    except ValueError:
        raise BadInput(f"{option} {text!r}: expected a comma-separated list of positive integers, e.g. 8,1") from None
    if not out or any(n < 1 for n in out):
        raise BadInput(f"{option} {text!r}: every value must be >= 1")
    no_repeat(option, text, out)  # a second world of the same configuration is no second configuration
    return out


def parse_jobs(text: str) -> int:
    """'auto' -> 0, else an integer >= 1."""
    t = str(text).strip().lower()
    if t == "auto":
        return 0
    try:
        n = int(t)
    except ValueError:
        n = 0
    if n < 1:
        raise BadInput(f"--jobs {text!r}: expected auto or an integer >= 1")
    return n


def parse_modes(text: str) -> tuple[str, ...]:
    out = tuple(p.strip().lower() for p in str(text).split(","))
    bad = [m for m in out if m not in MODES]
    if bad or not out:
        raise BadInput(f"--mode {text!r}: expected prefill, decode or both (prefill,decode)")
    no_repeat("--mode", text, out)
    return out


def parse_fixes(text: str) -> tuple[str, ...]:
    """'none,all' -> each a configuration; a set of named fixes is joined with '+'."""
    from tpdiag.fixes.registry import resolve

    out: dict[str, str] = {}  # the fix set -> the item that named it
    for item in str(text).split(","):
        item = item.strip().lower()
        if item in ("none", "stock"):
            name = "none"
        elif item == "all":
            resolve("all")
            name = "all"
        elif item == "auto":
            # compare's auto fixes a located cause and reruns; a rollout locates nothing, so a
            # fix set has to be named (registry's message would offer auto back)
            raise BadInput(f"--fix {text!r}: auto is compare's (fix and rerun until nothing "
                           "diverges); rollout tries fix sets: none, all, or fixes joined with '+'")
        else:
            name = "+".join(_resolve(text, item))
        if name in out:
            same = "is listed twice" if out[name] == item else f"is the same fix set as {out[name]}"
            raise BadInput(f"--fix {text!r}: {item} {same}; list each fix set once (the first is the reference)")
        out[name] = item
    if not out:
        raise BadInput(f"--fix {text!r}: expected e.g. none,all")
    return tuple(out)


def _resolve(text: str, item: str) -> tuple[str, ...]:
    from tpdiag.fixes.registry import catalogue, resolve

    try:
        return resolve(item.split("+"))
    except BadInput as e:
        bad = next((n for n in item.split("+") if n not in catalogue()), None)
        if bad is None:
            raise
        raise BadInput(f"--fix {text!r}: unknown fix {bad!r}; expected none, all, or any of "
                       f"{', '.join(catalogue())} (several joined with '+')") from None


def parse_padding(text: str) -> tuple[str, ...]:
    from tpdiag.rollout.compute import PADDINGS

    out = tuple(p.strip().lower() for p in str(text).split(",") if p.strip())
    if not out or any(p not in PADDINGS for p in out):
        raise BadInput(f"--padding {text!r}: expected one or more of {', '.join(PADDINGS)} (auto: prefill "
                       "right, decode left as generate(); packed: prefill in one row per micro-batch; static: decode "
                       "through a static KV cache, generate(cache_implementation=\"static\"); compiled: static with "
                       "generate()'s torch.compile on a GPU)")
    no_repeat("--padding", text, out)
    return out
