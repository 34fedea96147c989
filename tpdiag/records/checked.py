"""Which stored tensors this compare has already checked against their stored hashes, by the file
they are in, so a second RecordSet over the same file does not hash them again.

Why: the own-input pass after a region pass (runner/drill.py) diffs the region pass's records a
second time - its other worlds are hard links of the region pass's files, its reference reads
the region reference's file through `records_base` (records/store.py) - in new RecordSets, whose
per-set `_verified` starts empty: every tensor of ~1.4 GB per side (llama-1b at 1 x 2048) was
hashed again a minute after the region diff hashed it.

A RecordSet vouches for a record it checked for its own life: its file is mapped read-only then
(store.RecordSet.vouch). Here the same holds for the same file across the sets one compare opens:
the key is the file's identity when the set opened it (device, inode, size, modification and
change times in ns), the name the tensor is stored under there, its stored hash and the lane mix.
A file replaced (a copy, a rename over it) is another inode; one rewritten in place has new times
or size: both are hashed again. Kept only inside session() (runner/session.py: one compare), so a
gate, a report or a test that edits a file and reads it again in the same process checks afresh.
TPDIAG_CHECK_ONCE=0: every set hashes every tensor it reads (the old path, the A/B).
"""
from __future__ import annotations

import os

from tpdiag.base.scoped import Scoped

# a key is ~100 bytes; a long session starts over here
MAX_ENTRIES = 200_000
_CHECKED = Scoped(MAX_ENTRIES)
session = _CHECKED.session


def _on() -> bool:
    return _CHECKED.active and os.environ.get("TPDIAG_CHECK_ONCE", "1") != "0"


def identity(path: str) -> tuple | None:
    """The file's identity as a set opens it; None where it cannot be read (never matched)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def key(ident: tuple | None, name: str, stored_hash, version: int) -> tuple | None:
    if ident is None or not isinstance(stored_hash, str):
        return None
    return (*ident, name, stored_hash, version)


def seen(k: tuple | None) -> bool:
    """Whether a set of this compare checked the tensor this key names."""
    return k is not None and _on() and _CHECKED.get(k) is not None


def add(k: tuple | None) -> None:
    if _on():
        _CHECKED.put(k, True)


def linked(before: tuple | None, after: tuple | None) -> int:
    """A file this compare linked to a new name (runner/compare.py: an earlier pass's world read by a
    later pass): the tensors checked under its identity before the link count as checked under its
    identity after it. Why: link(2) sets the inode's change time, so every key of the file missed and
    the own-input diff hashed the region pass's linked worlds (every TP>1 record, GBs at real size)
    a second time. Carried only where nothing but the change time moved (the same device, inode,
    size and modification time): the content is the bytes checked, the link the only change. How
    many keys were carried."""
    if not _on() or before is None or after is None or before == after \
            or before[:4] != after[:4]:
        return 0
    n = len(before)
    moved = [k[n:] for k in list(_CHECKED.data) if k[:n] == before]
    for rest in moved:
        _CHECKED.put((*after, *rest), True)
    return len(moved)
