"""Whether a run's divergent configurations are judged further - the second pass (float64, ops) and
the confirmation - where some other configuration's world failed."""
from __future__ import annotations

from tpdiag.records.axes import entries


def judgeable(summary: dict) -> bool:
    """A divergent run, or one inconclusive only because some configurations' worlds failed: the
    reference ran and reproduced itself (analyse_run then sets no summary error), so what each
    configuration that ran found against it stands on its own and is judged as if the failed ones
    had not been asked for. The run stays inconclusive: a failed world never passes.
    Until 2026-12-02 one failed degree (user code that raises only at TP=4) left every other
    degree without its second pass and confirmation: a TP=2 that reads rounding alone read unknown."""
    if not isinstance(summary, dict):
        return False
    status = summary.get("status")
    if status == "divergent":
        return True
    if status != "inconclusive" or summary.get("error"):
        return False
    states = [d.get("status") if isinstance(d, dict) else None for d in entries(summary).values()]
    return "divergent" in states and set(states) <= {"bitwise", "divergent", "failed"}
