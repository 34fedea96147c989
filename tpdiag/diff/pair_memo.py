"""What the diff measured of a record pair, kept for the rest of the compare by the pair's content.

Why: the own-input pass after a region pass (runner/drill.py) diffs the region's records again -
its other worlds are the region pass's files, linked; its reference ran the same step again (its
fingerprint checked) - so every pair it compares is a pair the region diff compared a minute
before: the same bytes, a second full pass of float64 temporaries over GBs of records for the
same numbers (llama-1b 2 layers, 1 x 128 on 2 CPU cores: 44 of the own-input diff's 119 s).

The key is the pair's two stored hashes and their index entries (all but the record's number):
it is looked up only after diff/pair_read.read_pair read both tensors and checked them - each
against its stored hash, or both at once where their flat bytes are equal - so the bytes in hand
are the bytes those hashes name, and an edit of either file fails that check before any lookup.
A pair whose metas differ (another layout, other positions, another dtype) has another key.
"""
from __future__ import annotations

import copy
import json

from tpdiag.base.scoped import Scoped

# a few hundred bytes an entry; a long session starts over here
MAX_ENTRIES = 50_000
# Kept only inside session() (one compare: its region diff and the own-input diff after it), and
# dropped when it ends: a process that runs the diff again later - a notebook, the test suite, a
# gate after a compare - measures afresh with the code it has then (a measure patched in one test
# answered for the same content in the next: a false BUG at init, a non-bitwise pair as bitwise).
_MEMO = Scoped(MAX_ENTRIES)
session = _MEMO.session


def pair_key(ref, rm: dict, other, om: dict, *extra) -> tuple | None:
    """The content key of a checked pair; None where a side has no stored hash this tpdiag checks
    (an old run directory's records: measured every time)."""
    h, g = rm.get("stored_hash"), om.get("stored_hash")
    if h is None or g is None or ref.hash_version != other.hash_version or not ref.known_hashes():
        return None
    return (ref.hash_version, h, g, _canon(rm), _canon(om), *extra)


def context(*parts) -> str:
    """Inputs of a pair's assembly beyond its two index entries (the worlds' vocab padding, a
    flattened op's rows), as one key part."""
    return json.dumps(parts, sort_keys=True, default=str)


def _canon(m: dict) -> str:
    return json.dumps({k: v for k, v in m.items() if k != "idx"}, sort_keys=True, default=str)


def get(key):
    v = _MEMO.get(key)
    return copy.deepcopy(v) if v is not None else None


def put(key, value) -> None:
    if key is not None and _MEMO.active:  # the copy only where it is kept
        _MEMO.put(key, copy.deepcopy(value))


def clear() -> None:
    _MEMO.clear()


def cached(key, compute):
    """compute()'s result, or the one it gave for this key earlier in the process (key None:
    computed every time). The key names the function that computes (a replaced one is another
    key) and the content keys of the checked pairs it reads."""
    got = get(key)
    if got is not None:
        return got[0]
    value = compute()
    put(key, (value,))
    return value


def of(dd, *keys: str) -> tuple | None:
    """The content keys of these records' pairs in a DegreeDiff (None where one has none)."""
    out = tuple(dd.contents.get(k) for k in keys)
    return None if None in out else out


def read_once(device):
    """Each pair measured once (this module) and each stored tensor hash-checked once (records/checked),
    on `device` (records/hashing.checks_on; None: the host), for as long as the block runs: the one
    scope a compare (runner/session) and a gate (gate/once) read a run's records under."""
    import contextlib

    from tpdiag.records import checked
    from tpdiag.records.hashing import checks_on

    stack = contextlib.ExitStack()
    stack.enter_context(session())
    stack.enter_context(checked.session())
    stack.enter_context(checks_on(device))
    return stack
