"""The reference world's stored tensors checked against their stored hashes while the pass's other
worlds run.

Why: the diff checks every stored tensor it reads against the hash its world stored
(records/store.py: verify) - after the last world, on the critical path: the region pass after a
hash-first pass stores its reference's located modules whole (small-llama bf16 1 x 64 on 2 CPU
cores: 298 tensors, ~0.8 s of its diff's host time; llama-1b: GBs hashed on the parent's GPU),
while this process only polls the TP>1 world's markers. The reference's files are final once its
world finished ok, and records/checked.py keeps a check for the rest of the compare, keyed by the
file's identity (an edit after it is another identity, checked again by the diff). So the same
checks, begun in a thread when the reference's world is done, leave the diff that work already done.

Nothing is judged here: a tensor that does not match is not counted as checked, and the diff checks
it again and refuses it there, as it did; an unreadable set is left to the diff. Only inside a
compare's session (checked.session: outside one nothing is kept). TPDIAG_PRECHECK=0: none (the A/B).
"""
from __future__ import annotations

import os
import threading


class Precheck:
    def __init__(self, folder: str):
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(folder,), name="tpdiag-precheck", daemon=True)
        self.checked = 0

    def _run(self, folder: str) -> None:
        from tpdiag.records.store import RecordSet

        try:
            rs = RecordSet(folder)
            for m in rs.events:
                if self._stop.is_set():
                    return
                if m.get("stored") in (None, "hash") or m.get("stored_hash") is None:
                    continue
                try:
                    rs.tensor(m)  # verify=True: checked against its stored hash, kept (records/checked.py)
                    self.checked += 1
                except Exception:  # noqa: BLE001 - not counted as checked: the diff reads it and says why
                    continue
        except Exception:  # noqa: BLE001 - no readable set: the diff opens it and reports what fails
            return

    def done(self) -> None:
        """Wait for the checks (the diff reads next); stop() where the pass ends otherwise."""
        self._thread.join()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def start(folder: str) -> Precheck | None:
    """Checks of `folder`'s stored tensors begun in a thread (None: off, or no compare session)."""
    from tpdiag.records import checked

    if os.environ.get("TPDIAG_PRECHECK", "1") == "0" or not checked.active():
        return None
    p = Precheck(folder)
    p._thread.start()
    return p
