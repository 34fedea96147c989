"""Help strings for the CLI options, built from the tables the code validates against, so
`--help` cannot list a choice the code refuses or miss one it accepts. Light imports only:
`import tpdiag.cli` must not pull in torch."""
from __future__ import annotations


def _bar(xs) -> str:
    return " | ".join(xs)


def model() -> str:
    from tpdiag.models.presets import PRESETS

    return (f"{_bar(PRESETS)} (built-in presets) | hf:DIR (a local transformers model directory) | "
            "py:FILE.py:FUNC (your own model and plan, a tpdiag.Target); see docs/models.md")


def variant() -> str:
    from tpdiag.models.plans import VARIANTS

    return (f"plan variant of the built-in models: {_bar(VARIANTS)} (stable: NeMo RL's out-projections; "
            "sp: sequence parallelism)")


def fix_names() -> list[str]:
    from tpdiag.fixes.registry import catalogue

    return list(catalogue())


def fix() -> str:
    return ("none (default) | auto (fix and rerun until nothing diverges) | all | NAME[,NAME] with NAME one of "
            f"{', '.join(fix_names())} (tpdiag fixes; docs/causes.md)")


def variants() -> str:
    from tpdiag.models.plans import VARIANTS

    return (f"mitigation matrix: run each variant at every degree; a variant is a plan ({_bar(VARIANTS)}), "
            "fix:NAME, fix:all, or PLAN+fix:NAME, e.g. stock,stable,fix:all,stable+fix:tp-invariant-linear")


def choice(table: str) -> str:
    from tpdiag import config

    return _bar(getattr(config, table))
