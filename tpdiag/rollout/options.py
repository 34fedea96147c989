"""`tpdiag rollout`'s option values parsed: each a tuple of the values to try (or --jobs' count);
bad input is one BadInput naming the option."""
from __future__ import annotations

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
    return tuple(dict.fromkeys(out))


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
    out = tuple(dict.fromkeys(p.strip().lower() for p in str(text).split(",")))
    bad = [m for m in out if m not in MODES]
    if bad or not out:
        raise BadInput(f"--mode {text!r}: expected prefill, decode or both (prefill,decode)")
    return out


def parse_fixes(text: str) -> tuple[str, ...]:
    """'none,all' -> each a configuration; a set of named fixes is joined with '+'."""
    from tpdiag.fixes.registry import resolve

    out = []
    for item in str(text).split(","):
        item = item.strip().lower()
        if item in ("none", "stock"):
            out.append("none")
        elif item == "all":
            resolve("all")
            out.append("all")
        else:
            out.append("+".join(resolve(item.split("+"))))
    if not out:
        raise BadInput(f"--fix {text!r}: expected e.g. none,all")
    return tuple(dict.fromkeys(out))


def parse_padding(text: str) -> tuple[str, ...]:
    from tpdiag.rollout.compute import PADDINGS

    out = tuple(dict.fromkeys(p.strip().lower() for p in str(text).split(",") if p.strip()))
    if not out or any(p not in PADDINGS for p in out):
        raise BadInput(f"--padding {text!r}: expected one or more of {', '.join(PADDINGS)} (auto: prefill "
                       "right, decode left as generate())")
    return out
