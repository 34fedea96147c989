"""`tpdiag gate`: policy (policy.py), verdict over a run directory (verdict.py), CI outputs
(junit.py, annotations.py). The library entry is `evaluate(run_dir, load_policy(path))`."""
from __future__ import annotations

from tpdiag.gate.policy import PHASES, Budget, Policy, load_policy
from tpdiag.gate.verdict import DegreeResult, GateResult, Violation, evaluate

__all__ = ["PHASES", "Budget", "DegreeResult", "GateResult", "Policy", "Violation", "evaluate", "load_policy"]
