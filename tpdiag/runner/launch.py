"""Launch one TP world as local processes and watch it: completion markers, errors, timeout.

The parent owns the rendezvous store (bound to port 0, so two compares never collide) and
kills every rank it started, whatever happens - no orphan processes.
"""
from __future__ import annotations

import math
import os
import re
import signal
import threading
import time
from dataclasses import asdict, dataclass, field

from tpdiag.base.configs import folder
from tpdiag.config import WorldConfig
from tpdiag.records.paths import RESULT, world_file
from tpdiag.runner import progress
# prestart, prewarm: importable from here too, as the CLI imports them
from tpdiag.runner.start_context import (RERAN_MAIN, _context, _rank_vars, _restore_env, prestart,  # noqa: F401
                                         prewarm, rank_entry, unguarded_line)


@dataclass
class WorldResult:
    label: str
    degree: int
    status: str  # ok | failed
    out_dir: str
    wall_s: float
    error: str | None = None
    rank_errors: dict = field(default_factory=dict)
    # per rank: phase wall times (s) and peak memory (bytes), from its completion marker
    rank_timings: list = field(default_factory=list)
    # rank 0's backend flags and tensor dtypes (runner/step.py), from its completion marker
    numerics: dict | None = None

    def to_dict(self) -> dict:
        return asdict(self)




def drop_markers(folder: str) -> None:
    """A world folder made ready for a world: only the markers a rank writes (rankN.done,
    rankN.error) from an earlier run there are removed - any other file in tpN/ is not tpdiag's to
    delete."""
    os.makedirs(folder, exist_ok=True)
    for name in os.listdir(folder):
        if _MARKER.fullmatch(name) and not os.path.isdir(os.path.join(folder, name)):
            os.unlink(os.path.join(folder, name))




_MARKER = re.compile(r"rank[0-9]+\.(done|error)")
# the ranks' environment is this process's, set around their start and restored after it
_LAUNCHING = threading.Lock()


def run_world(cfg: WorldConfig, timeout_s: float, on_status=None, entry=None, cancel=None,
              gpu_offset: int = 0) -> WorldResult:
    """`entry`: each rank's function, with worker.main's arguments and contract (rankR.done /
    rankR.error markers in cfg.out_dir); default worker.main (compare's step). `cancel`: an
    Event another thread sets to end the world now (its ranks killed; status 'failed').
    `gpu_offset`: worker.main's rank R runs on GPU R + gpu_offset."""
    from datetime import timedelta

    import torch.distributed as dist

    from tpdiag.base import files as io
    from tpdiag.runner import worker

    world = cfg.degree
    try:
        if not math.isfinite(timeout_s) or timeout_s <= 0:
            raise ValueError
        timedelta(seconds=timeout_s)
    except (ValueError, OverflowError, TypeError):
        from tpdiag.errors import BadInput

        raise BadInput(f"--timeout {timeout_s!r}: expected a finite number of seconds > 0") from None
    drop_markers(cfg.out_dir)
    from tpdiag.runner.meta_memo import launcher_folder

    launcher_folder()
    t0 = time.perf_counter()
    store = dist.TCPStore("127.0.0.1", 0, world_size=world + 1, is_master=True,
                          wait_for_workers=False, timeout=timedelta(seconds=timeout_s))
    # RANK_ENV and PYTHONSAFEPATH are for the ranks (the fork server, or a spawned/forked rank, takes
    # them at its start), not for the caller: a library user's process (a notebook, a test session)
    # would keep OMP_NUM_THREADS=1 and PYTHONSAFEPATH for every later subprocess
    with _LAUNCHING:  # two worlds side by side (runner/side_by_side.py): one sets and restores at a time
        saved = _rank_vars()
        try:
            ctx = _context(cfg.model)
            env = dict(os.environ)  # the ranks' environment now (rank_entry), not the fork server's at its start
        finally:
            _restore_env(saved)
    launched_at = time.time()
    procs = [ctx.Process(target=rank_entry, name=f"tpdiag-{folder(world)}-rank{r}",
                         args=(env, entry or worker.main, r, world, "127.0.0.1", store.port, cfg.to_dict(),
                               timeout_s, os.getpid(), launched_at),
                         kwargs={"gpu_offset": gpu_offset} if gpu_offset else {})
             for r in range(world)]
    if on_status:
        on_status(cfg.label, "running")
    result = None
    old_term = _terminate_as_interrupt()
    try:
        with _LAUNCHING:
            saved = _rank_vars()
            try:
                _context(cfg.model)  # the ranks' environment, for the fork server's start
                for p in procs:
                    _start(ctx, p)
            finally:
                _restore_env(saved)
        deadline = time.monotonic() + timeout_s
        shown, polled = None, time.monotonic()
        while result is None:
            # a decode world's rank 0 writes how far its calls are (runner/progress.py)
            if on_status and cfg.mode == "decode" and time.monotonic() - polled > 0.5:
                polled = time.monotonic()
                text = progress.read(cfg.out_dir)
                if text and text != shown:
                    shown = text
                    on_status(cfg.label, f"running:{text}")
            done = [os.path.exists(worker.marker(cfg.out_dir, r, "done")) for r in range(world)]
            errs = {r: worker.marker(cfg.out_dir, r, "error") for r in range(world)}
            errs = {r: p for r, p in errs.items() if os.path.exists(p)}
            if all(done):
                result = WorldResult(cfg.label, world, "ok", cfg.out_dir, time.perf_counter() - t0,
                                     rank_timings=_rank_timings(cfg.out_dir, world),
                                     numerics=_numerics(cfg.out_dir))
                break
            dead = [r for r, p in enumerate(procs)
                    if p.exitcode is not None and not done[r] and r not in errs]
            if errs or dead:
                result = _failure(cfg, procs, world, t0)
                if result is not None:
                    break
            if cancel is not None and cancel.is_set():
                result = WorldResult(cfg.label, world, "failed", cfg.out_dir, time.perf_counter() - t0,
                                     error="cancelled")
                break
            if time.monotonic() > deadline:
                pending = [r for r in range(world) if not done[r]]
                result = WorldResult(cfg.label, world, "failed", cfg.out_dir, time.perf_counter() - t0,
                                     error=f"timed out after {timeout_s:g} s; ranks not done: {pending}")
                break
            time.sleep(0.02)
    finally:
        # Interrupted (Ctrl-C, SIGTERM) or failed: no grace, the ranks are killed now.
        _reap(procs, grace_s=3.0 if result is not None and result.error != "cancelled" else 0.0)
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)
        del store
    progress.clear(cfg.out_dir)
    if on_status:
        on_status(cfg.label, result.status)
    io.write_json(world_file(cfg.out_dir, RESULT), result.to_dict())
    return result


def _numerics(out_dir: str) -> dict | None:
    from tpdiag.base import files as io
    from tpdiag.runner import worker

    try:
        n = io.read_json(worker.marker(out_dir, 0, "done")).get("numerics")
    except Exception:  # noqa: BLE001 - informational, as the timings
        return None
    return n if isinstance(n, dict) else None


def _rank_timings(out_dir: str, world: int) -> list:
    from tpdiag.base import files as io
    from tpdiag.runner import worker

    out = []
    for r in range(world):
        try:
            t = io.read_json(worker.marker(out_dir, r, "done")).get("timings")
        except Exception:  # noqa: BLE001 - timings are informational; the marker's presence decides
            t = None
        out.append(t if isinstance(t, dict) else {})
    return out


_PEER_LOST = ("Connection closed", "Connection reset", "remote worker", "Broken pipe",
              "NCCL communicator was aborted", "ProcessGroupNCCL")


def _failure(cfg: WorldConfig, procs, world: int, t0: float) -> WorldResult | None:
    """Name the rank that failed first: a rank that died without a word outranks the ranks
    that then lost their peer, and an error of its own outranks 'connection closed'."""
    from tpdiag.base import files as io
    from tpdiag.runner import worker
    from tpdiag.runner.rank_errors import describe

    time.sleep(0.5)  # siblings failing for the same reason report meanwhile
    rank_errors, silent, in_user_code = {}, [], set()
    for r, p in enumerate(procs):
        path = worker.marker(cfg.out_dir, r, "error")
        if os.path.exists(path):
            try:
                e = io.read_json(path)
                rank_errors[r] = describe(e)
                if e.get("where"):
                    in_user_code.add(r)
            except Exception:
                rank_errors[r] = "error marker unreadable"
        elif p.exitcode is not None and not os.path.exists(worker.marker(cfg.out_dir, r, "done")):
            silent.append(r)
    if not rank_errors and not silent:
        return None
    if silent:
        r = silent[0]
        code = procs[r].exitcode
        if code == RERAN_MAIN:
            from tpdiag.errors import UnguardedMain

            # every rank of every world would re-run the script: no world of this run can start
            raise UnguardedMain(unguarded_line(f"TP={world}'s rank{'s' if world > 1 else ''}"))
        how = f"signal {-code}" if code < 0 else f"exit code {code}"
        error = f"rank {r} died ({how}) before finishing its work"
    else:
        own = [r for r, m in rank_errors.items() if not any(k in m for k in _PEER_LOST)]
        r = min(own) if own else min(rank_errors)
        # 'rank 0: IndexError at my_model.py:42 in forward: ...' when the user's code raised
        error = f"rank {r}{':' if r in in_user_code else ' raised'} {rank_errors[r]}"
    return WorldResult(cfg.label, world, "failed", cfg.out_dir, time.perf_counter() - t0,
                       error=error, rank_errors=rank_errors)


def _start(ctx, p) -> None:
    """p.start() with SIGINT/SIGTERM held back: interrupted half-way, a rank could be running
    without the launcher knowing its pid (so nobody would kill it). The signal is delivered
    right after, when the rank is known and the launcher's `finally` reaps it."""
    if ctx.get_start_method() == "forkserver":
        from multiprocessing import forkserver

        forkserver.ensure_running()  # spawned with signals unblocked: its ranks inherit its mask
    main_thread = threading.current_thread() is threading.main_thread()
    held = {signal.SIGINT, signal.SIGTERM}
    old = signal.pthread_sigmask(signal.SIG_BLOCK, held) if main_thread else None
    try:
        p.start()
    finally:
        if old is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _terminate_as_interrupt():
    """SIGTERM (kill, a CI job's cancel, a batch system) would end the parent at once, skipping
    every `finally` - and leave its ranks running. Raise KeyboardInterrupt instead, so the ranks
    are killed and the CLI reports 'interrupted'. Returns the previous handler (None: not set)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def on_term(signum, frame):
        raise KeyboardInterrupt("terminated (SIGTERM)")

    try:
        return signal.signal(signal.SIGTERM, on_term)
    except (ValueError, OSError):
        return None


def _reap(procs, grace_s: float = 3.0) -> None:
    try:
        end = time.monotonic() + grace_s
        for p in procs:
            if p.pid is None or grace_s <= 0:
                continue
            p.join(max(0.0, end - time.monotonic()))
    finally:
        # Kill before waiting on anything, so a second Ctrl-C during the joins leaves no rank behind.
        for p in procs:
            if p.pid is not None and p.is_alive():
                p.kill()
        for p in procs:
            if p.pid is not None:
                p.join(5)
