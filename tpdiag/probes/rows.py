"""Hash mode's compact records: Recorder.add's fast path keeps a row per record (a list of
12 fields) and the metas are built from the rows only when the records are read - the host time
a small step pays per record (docs/benchmarks.md, "Probe cost in hash mode"; the cut measured:
`git show d055ef2:docs/benchmarks.md`, "Host work per record, session 8"). A row's later keys
(module_probes' consumers) go in its extras, merged into its meta when it is built."""
from __future__ import annotations

from tpdiag.records.keys import record_key

_DTYPE_NAMES: dict = {}


def dtype_name(dtype) -> str:
    n = _DTYPE_NAMES.get(dtype)
    if n is None:
        n = _DTYPE_NAMES[dtype] = str(dtype).replace("torch.", "")
    return n


# a pending row of Recorder.add's fast path (a list: `extras` fills its last item)
_STEP, _PHASE, _MODULE, _KIND, _CALL, _NAME, _LAYOUT, _STYLE, _CLS, _DTYPE, _SHAPE, _EXTRAS = range(12)


def materialise(records: list, rows: list) -> None:
    """Pending rows onto records, in order: a compact row becomes (meta, None) with the meta
    Recorder.add's general path builds for a whole plain tensor in hash mode, keys in the same
    order (later keys - consumers - after them)."""
    for row in rows:
        if type(row) is tuple:  # (meta, tensor), made whole by the general path
            records.append(row)
            continue
        step, phase, module, kind, call, name, layout, style, cls, dtype, shape, extras = row
        meta = {
            "idx": len(records), "step": step, "phase": phase, "module": module, "kind": kind,
            "call": call, "name": name, "placement": layout, "style": style, "cls": cls,
            "dtype": _DTYPE_NAMES.get(dtype) or dtype_name(dtype), "local_shape": list(shape),
            "key": record_key(step, phase, module, kind, call, name),
        }
        if extras and "piece" in extras:
            # a decode call's row (pieces.add_span): the piece's keys where hash_piece puts them
            for k in ("piece", "piece_dim", "piece_fold"):
                if k in extras:
                    meta[k] = extras[k]
        meta["hash_layout"] = "replicate"
        meta["full_shape"] = list(shape)
        if extras:
            meta.update(extras)
        row[_EXTRAS] = meta  # keys added later go to the meta itself
        records.append((meta, None))
    rows.clear()


def extras(record) -> dict:
    """The dict a record's later keys go in (module_probes' consumers): its meta, or a pending
    row's own, merged into its meta when the row is made one."""
    if type(record) is dict:
        return record
    e = record[_EXTRAS]
    if e is None:
        e = record[_EXTRAS] = {}
    return e


def consumers_of(record) -> list:
    """The consumers a record has so far (read only: a pending row gets no extras dict)."""
    e = record if type(record) is dict else record[_EXTRAS]
    return e.get("consumers", ()) if e else ()


def module_of(record) -> str:
    return record["module"] if type(record) is dict else record[_MODULE]
