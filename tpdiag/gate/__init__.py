"""`tpdiag gate`: policy (policy.py), verdict over a run directory (verdict.py; what it found:
result.py), CI outputs (junit.py, annotations.py). The library entry is
`evaluate(run_dir, load_policy(path))`."""
from __future__ import annotations

from tpdiag.gate.policy import PHASES, PRESETS, Budget, Policy, load_policy, with_allowed
from tpdiag.gate.result import DegreeResult, GateResult, Violation
from tpdiag.gate.verdict import evaluate

__all__ = ["PHASES", "PRESETS", "Budget", "DegreeResult", "GateResult", "Policy", "Violation", "evaluate", "load_policy", "with_allowed"]
