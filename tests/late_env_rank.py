"""A rank entry for tests/test_rank_env.py (worker.main's contract: a rankR.done marker): it writes
what its environment says of TPDIAG_TEST_LATE_VAR into the marker."""
import os
import time


def main(rank, world, host, port, cfg_dict, timeout_s, launcher_pid=None, launched_at=None):
    from tpdiag.base import files as io
    from tpdiag.config import WorldConfig
    from tpdiag.runner import worker
    from tpdiag.runner.rank_exit import leave

    cfg = WorldConfig.from_dict(cfg_dict)
    io.write_json(worker.marker(cfg.out_dir, rank, "done"), {"rank": rank, "time": time.time(), "timings": {},
                                                             "late": os.environ.get("TPDIAG_TEST_LATE_VAR")})
    leave(0)
