import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_cli(*args, env=None, timeout=600):
    """Run the real console entry point in a subprocess (as a user would)."""
    e = dict(os.environ)
    e.update(env or {})
    e.setdefault("COLUMNS", "160")
    return subprocess.run([sys.executable, "-m", "tpdiag.cli", *args], capture_output=True, text=True,
                          env=e, timeout=timeout, cwd=ROOT)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gloo_world(worker, world: int, timeout: float = 60):
    """Run worker(rank, world, port, queue) in a real `world`-process spawn world on a free
    port; returns what rank 0 put on the queue."""
    import torch.multiprocessing as mp

    q = mp.get_context("spawn").Queue()
    port = free_port()
    mp.start_processes(_exit_after, args=(worker, world, port, q), nprocs=world, start_method="spawn")
    return q.get(timeout=timeout)


def _exit_after(rank, worker, world, port, q):
    """worker(...), then leave without interpreter teardown: on torch 2.13 a gloo rank can abort
    in its destructors after all its work is done ('terminate called without an active
    exception', SIGABRT) - tpdiag's own worker skips teardown for the same reason. A worker
    that raises still fails the world with its traceback."""
    worker(rank, world, port, q)
    q.close()
    q.join_thread()  # what rank 0 put on the queue is flushed before the process ends
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@pytest.fixture(scope="session")
def stock_run(tmp_path_factory):
    """ONE real compare of the built-in model at TP=1,2,4,8 (gloo), shared by every test that reads it."""
    out = tmp_path_factory.mktemp("stock") / "run"
    p = run_cli("compare", "--tp", "1,2,4,8", "--out", str(out), "--no-confirm")
    assert p.returncode == 0, p.stderr + p.stdout
    return out


@pytest.fixture(scope="session")
def tp12_run(tmp_path_factory):
    """ONE real compare at TP=1,2 shared by the report and gate tests; tests edit copies, never this."""
    out = tmp_path_factory.mktemp("tp12") / "run"
    p = run_cli("compare", "--tp", "1,2", "--out", str(out), "--no-confirm", "--format", "json")
    assert p.returncode == 0, p.stderr + p.stdout
    return out
