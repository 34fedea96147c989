"""A user's own training script (tests/user_*.py) captured in real gloo worlds, as the user runs it
under torchrun: one world per (degree, variant), each writing its capture to BASE/<degree>-<variant>,
which the tests then diff and gate."""
import importlib
import os
import sys

import pytest

from conftest import ROOT, gloo_world


def _rank(rank, world, port, q):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    script = importlib.import_module(os.environ["USER_SCRIPT"])

    dist.init_process_group("gloo", rank=rank, world_size=world)
    getattr(script, os.environ["USER_ENTRY"])(os.environ["USER_OUT"], os.environ["USER_VARIANT"])
    dist.barrier()
    if rank == 0:
        q.put("done")


def capture_worlds(base, script: str, entry: str, worlds):
    """tests/<script>.py's `entry(out, variant)` in a gloo world of each (degree, variant) of
    `worlds`, one after another; returns base."""
    mp = pytest.MonkeyPatch()
    try:
        for n, variant in worlds:
            mp.setenv("USER_SCRIPT", script)
            mp.setenv("USER_ENTRY", entry)
            mp.setenv("USER_OUT", str(base / f"{n}-{variant}"))
            mp.setenv("USER_VARIANT", variant)
            mp.setenv("OMP_NUM_THREADS", "1")
            assert gloo_world(_rank, n, timeout=180) == "done"
    finally:
        mp.undo()
    return base
