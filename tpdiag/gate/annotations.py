"""`tpdiag gate` on GitHub Actions: one workflow-command annotation for the run page."""
from __future__ import annotations

from tpdiag.gate.result import GateResult


def github_annotation(res: GateResult) -> str | None:
    """A workflow command that GitHub Actions shows on the run page; % and newlines must be escaped."""
    if res.status == "pass":
        return None
    v = res.first_violation
    msg = (f"first divergent {v.unit} beyond policy: {v.line()}" if res.status == "fail"
           else f"inconclusive evidence: {res.problems[0]}")
    msg = msg.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")
    return f"::error title=tpdiag::{msg}"
