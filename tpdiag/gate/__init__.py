"""`tpdiag gate`: policy (policy.py), verdict over a run directory (verdict.py), CI outputs
(junit.py, annotations.py). The library entry is `evaluate(run_dir, load_policy(path))`."""
from __future__ import annotations

from tpdiag.gate.policy import PHASES, PRESETS, Budget, Policy, load_policy, with_allowed
from tpdiag.gate.verdict import DegreeResult, GateResult, Violation, evaluate

__all__ = ["PHASES", "PRESETS", "Budget", "DegreeResult", "GateResult", "Policy", "Violation", "evaluate", "load_policy", "with_allowed"]
