"""Whether a run directory is one `tpdiag confirm` may rerun and write into: a finished compare run
of this tpdiag's schema (report and gate refuse the rest through records/integrity.py)."""
from __future__ import annotations

from tpdiag.errors import BadInput, Inconclusive
from tpdiag.records.check import MAKE
from tpdiag.records.integrity import SCHEMA, schema_ok
from tpdiag.records.paths import MANIFEST, SUMMARY
from tpdiag.records.rundir import incomplete


def require_confirmable(path: str, manifest, summary) -> None:
    """Inconclusive unless RUN_DIR is a finished compare run this tpdiag reads: confirm reran the
    degrees of a summary.json of schema 99 (another tpdiag's) or of an interrupted compare's
    earlier run as if they were this run's, and wrote its confirmations into them (exit 0)."""
    if not isinstance(manifest, dict) or not isinstance(summary, dict):
        raise Inconclusive(f"{path}: manifest.json or summary.json is not a JSON object (not a tpdiag run)")
    if manifest.get("tool") != "tpdiag compare":
        raise BadInput(f"RUN_DIR {path!r}: not a tpdiag compare run (manifest.json tool "
                       f"{manifest.get('tool')!r}); confirm reruns a compare's degrees ({MAKE})")
    why = incomplete(path, manifest)
    if why:
        raise Inconclusive(f"{why}; run the compare again before confirming it")
    for name, doc in ((MANIFEST, manifest), (SUMMARY, summary)):
        if not schema_ok(doc.get("schema")):
            raise Inconclusive(f"{path}/{name} schema {doc.get('schema')!r}: this tpdiag reads schema {SCHEMA} "
                               "(a run of another tpdiag version: confirm it with that version, or rerun the compare)")
