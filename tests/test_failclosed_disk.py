"""Fail closed, round 4: a full disk at the first write. compare takes RUN_DIR/.tpdiag.lock before anything
else; on a full file system (seen on a tmpfs filled to the last byte) writing its holder failed with a bare
`error: OSError: [Errno 28] No space left on device` naming no file. Now one line names --out and what
to do (exit 2), and neither the lock file nor a directory made for it is left behind. A full disk later
in the run (records, the second pass) is in test_faults_more.py / test_failclosed_passes.py.
"""
import errno
import os

import pytest

from tpdiag.errors import BadInput


def _enospc(*a, **k):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.parametrize("existing", [True, False])
def test_a_full_disk_at_the_lock_is_one_line_and_leaves_nothing(tmp_path, monkeypatch, existing):
    from tpdiag.records import lock

    run = tmp_path / "run"
    if existing:
        run.mkdir()
    monkeypatch.setattr(lock.os, "pwrite", _enospc)
    with pytest.raises(BadInput, match=r"--out .*run: cannot write its lock file \(No space left on device\)"):
        with lock.hold(str(run)):
            pass
    assert run.is_dir() == existing and (not existing or os.listdir(run) == [])
