"""`tpdiag gate`'s divergence policy: a TOML file read into a frozen Policy (default: nothing may diverge)."""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from tpdiag.errors import BadInput

PHASES = ("init", "forward", "loss", "backward", "optimizer")
_TOP_KEYS = {"allow_causes", "budgets", "degrees", "phases", "description"}
_BUDGET_KEYS = {"max_ulp", "max_abs", "phases"}


@dataclass(frozen=True)
class Budget:
    glob: str
    max_ulp: int | None = None
    max_abs: float | None = None
    phases: tuple[str, ...] | None = None

    def covers(self, row: dict) -> bool:
        return fnmatch.fnmatchcase(row["module"], self.glob) and (self.phases is None or row["phase"] in self.phases)

    def within(self, row: dict) -> bool:
        # A limit on ULP cannot be met by a record without an ULP distance (NaN pattern, integer): fail closed.
        if self.max_ulp is not None and (row["max_ulp"] is None or row["max_ulp"] > self.max_ulp):
            return False
        return self.max_abs is None or (row["max_abs"] is not None and row["max_abs"] <= self.max_abs)

    def describe(self) -> str:
        lim = [f"max_ulp {self.max_ulp}" if self.max_ulp is not None else "",
               f"max_abs {self.max_abs:g}" if self.max_abs is not None else ""]
        return f"budget {self.glob!r} ({', '.join(x for x in lim if x)})"


@dataclass(frozen=True)
class Policy:
    """Default: nothing may diverge, every degree and phase is gated."""

    allow_causes: tuple[str, ...] = ()
    budgets: tuple[Budget, ...] = ()
    degrees: tuple[str, ...] | None = None
    phases: tuple[str, ...] | None = None
    source: str = "default (nothing may diverge)"
    warnings: tuple[str, ...] = ()

    def budget_for(self, row: dict) -> Budget | None:
        return next((b for b in self.budgets if b.covers(row)), None)


def _str_list(path: str, key: str, v, allowed=None) -> tuple[str, ...]:
    if not isinstance(v, list) or not all(isinstance(x, (str, int)) and not isinstance(x, bool) for x in v):
        raise BadInput(f"--policy {path}: {key} must be a list, e.g. {key} = [\"...\"]")
    out = tuple(str(x) for x in v)
    bad = [x for x in out if allowed is not None and x not in allowed]
    if bad:
        raise BadInput(f"--policy {path}: {key} has {bad[0]!r}; expected any of {', '.join(allowed)}")
    return out


def _budget(path: str, glob: str, t) -> Budget:
    if not isinstance(t, dict):
        raise BadInput(f"--policy {path}: budgets.{glob!r} must be a table with max_ulp and/or max_abs")
    extra = set(t) - _BUDGET_KEYS
    if extra:
        raise BadInput(f"--policy {path}: budgets.{glob!r} has unknown key {sorted(extra)[0]!r}; "
                       f"expected {', '.join(sorted(_BUDGET_KEYS))}")
    if "max_ulp" not in t and "max_abs" not in t:
        raise BadInput(f"--policy {path}: budgets.{glob!r} needs max_ulp and/or max_abs")
    ulp, mabs = t.get("max_ulp"), t.get("max_abs")
    if ulp is not None and (isinstance(ulp, bool) or not isinstance(ulp, int) or ulp < 0):
        raise BadInput(f"--policy {path}: budgets.{glob!r}.max_ulp {ulp!r}: expected an integer >= 0")
    if mabs is not None and (isinstance(mabs, bool) or not isinstance(mabs, (int, float)) or mabs < 0):
        raise BadInput(f"--policy {path}: budgets.{glob!r}.max_abs {mabs!r}: expected a number >= 0")
    phases = _str_list(path, f"budgets.{glob!r}.phases", t["phases"], PHASES) if "phases" in t else None
    return Budget(glob, ulp, float(mabs) if mabs is not None else None, phases)


def load_policy(path: str | None) -> Policy:
    if not path:
        return Policy()
    try:
        import tomllib
    except ImportError:  # Python 3.10
        try:
            import tomli as tomllib
        except ImportError:
            raise BadInput(f"--policy {path}: reading TOML needs Python 3.11+ or the tomli package") from None
    from tpdiag.base import files as io
    from tpdiag.records.causes import labels

    try:
        with io.open_regular(path, None, limit=io.LIMIT_SMALL, error=BadInput) as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise BadInput(f"--policy {path}: no such file") from None
    except BadInput as e:
        raise BadInput(f"--policy {e}") from None
    except tomllib.TOMLDecodeError as e:
        raise BadInput(f"--policy {path}: not valid TOML ({e})") from None
    except RecursionError:
        raise BadInput(f"--policy {path}: not valid TOML (nested too deeply)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise BadInput(f"--policy {path}: unreadable ({getattr(e, 'strerror', None) or e})") from None
    extra = set(data) - _TOP_KEYS
    if extra:
        raise BadInput(f"--policy {path}: unknown key {sorted(extra)[0]!r}; expected {', '.join(sorted(_TOP_KEYS))}")
    allow = _str_list(path, "allow_causes", data.get("allow_causes", []), labels())
    if "non-finite" in allow:
        raise BadInput(f"--policy {path}: allow_causes has 'non-finite'; NaN or Inf at one side only is never "
                       "allowed (fix the model, or gate the degrees that stay finite)")
    warnings = (("allow_causes has 'unknown': a divergence nothing could judge passes this gate",)
                if "unknown" in allow else ())
    budgets = data.get("budgets", {})
    if not isinstance(budgets, dict):
        raise BadInput(f"--policy {path}: budgets must be tables, e.g. [budgets.\"layers.*.wo\"] max_ulp = 64")
    if data.get("degrees") == []:
        # no degree gated: every run, a bug's included, would pass on no evidence checked
        raise BadInput(f"--policy {path}: degrees = [] gates no degree, so any run would pass; list the degrees "
                       "to gate, or leave degrees out to gate every one")
    return Policy(
        allow_causes=allow, warnings=warnings,
        budgets=tuple(_budget(path, g, t) for g, t in budgets.items()),
        degrees=_str_list(path, "degrees", data["degrees"]) if "degrees" in data else None,
        phases=_str_list(path, "phases", data["phases"], PHASES) if "phases" in data else None,
        source=path)


# `--allow NAME`: a preset of causes by class, so CI needs no hand-listed cause names
PRESETS = {"rounding": "every rounding-class cause (a reordered or re-blocked computation of the same "
                       "function); bugs, non-finite and unknown still fail"}


def with_allowed(policy: Policy, allow: str | None) -> Policy:
    """The policy with `--allow rounding` (or comma-separated cause names) added to its allowed
    causes. Never non-finite; `unknown` only by name, with the policy file's warning."""
    if not allow:
        return policy
    from dataclasses import replace

    from tpdiag.records.causes import labels, of_class

    names = [x.strip() for x in allow.split(",") if x.strip()]
    if not names:
        raise BadInput(f"--allow {allow!r}: expected a preset ({', '.join(PRESETS)}) or cause names")
    add: list[str] = []
    for n in names:
        if n in PRESETS:
            add += list(of_class("rounding"))
        elif n == "non-finite":
            raise BadInput("--allow non-finite: NaN or Inf at one side only is never allowed")
        elif n in labels():
            add.append(n)
        else:
            raise BadInput(f"--allow {n!r}: expected a preset ({', '.join(PRESETS)}) or a cause name "
                           f"({', '.join(c for c in labels() if c != 'non-finite')})")
    allowed = tuple(dict.fromkeys(policy.allow_causes + tuple(add)))
    warnings = policy.warnings
    if "unknown" in add and "unknown" not in policy.allow_causes:
        warnings += ("--allow unknown: a divergence nothing could judge passes this gate",)
    base = policy.source if policy.source != Policy.source else "default"
    return replace(policy, allow_causes=allowed, warnings=warnings, source=f"{base} + --allow {allow}")
