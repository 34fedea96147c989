"""Launch one TP world as local processes and watch it: completion markers, errors, timeout.

The parent owns the rendezvous store (bound to port 0, so two compares never collide) and
kills every rank it started, whatever happens - no orphan processes.
"""
from __future__ import annotations

import math
import multiprocessing as mp
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
from tpdiag.runner.determinism import RANK_ENV

# torch._inductor: torch.use_deterministic_algorithms (determinism.setup) imports it, ~0.75 s of
# CPU in every rank on a 2-core CI machine when not already in the fork server (it starts no thread)
_PRELOAD = ["torch", "torch.distributed.tensor.parallel", "torch._inductor", "tpdiag.runner.worker",
            "tpdiag.runner.step", "tpdiag.models.tiny_llama",
            # what every world's rank imported on its own past the modules above (30 modules: 5 ms of
            # CPU a rank from bytecode, 30 ms compiled from source): the build, the probes, the
            # record hash, the gather and the records' writing
            "tpdiag.models.build", "tpdiag.models.meta_init", "tpdiag.models.shard_init", "tpdiag.models.ties",
            "tpdiag.probes.module_probe", "tpdiag.probes.collectives", "tpdiag.probes.oracle_hooks",
            "tpdiag.kernels.record_hash", "tpdiag.kernels.grad_norm", "tpdiag.kernels.grad_carry",
            "tpdiag.kernels.tree", "tpdiag.fixes.attention", "tpdiag.diff.bits", "tpdiag.records.store",
            "tpdiag.runner.gather", "tpdiag.runner.decode", "tpdiag.runner.determinism",
            "tpdiag.runner.fingerprint", "tpdiag.runner.flags", "tpdiag.runner.losses",
            "tpdiag.runner.pristine", "tpdiag.runner.sdpa_ran", "tpdiag.runner.attention",
            "tpdiag.runner.meta_memo"]


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


def _import_root_first() -> None:
    """Ranks import the tpdiag this process runs, never a `tpdiag/` folder in the working directory.

    The fork server starts as `python -c ...`, so its sys.path begins with the working directory; a
    folder named tpdiag there (a clone's parent) is a namespace package that shadows an install
    found by a meta-path finder (pip's editable installs), and every rank then dies on import with
    its error unwritten. With this package's root on PYTHONPATH the real (regular) package wins."""
    # this file's own place, not tpdiag.__file__: under `python -m tpdiag` run from such a
    # directory the name `tpdiag` itself may be that namespace package (its __file__ is None)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if not paths or os.path.abspath(paths[0]) != root:
        os.environ["PYTHONPATH"] = os.pathsep.join([root, *(p for p in paths if os.path.abspath(p) != root)])


# Set for the fork server only (it starts as `python -c ...`, whose sys.path would begin with '', the
# working directory: a torch/ or tpdiag/ package there would be what it preloads and every rank
# runs). The worker drops it again where tpdiag set it, so the user's own subprocesses are as before.
SAFE_PATH_MARK = "TPDIAG_SET_PYTHONSAFEPATH"


def _safe_path() -> None:
    if "PYTHONSAFEPATH" not in os.environ:
        os.environ["PYTHONSAFEPATH"] = "1"
        os.environ[SAFE_PATH_MARK] = "1"


def _context(model: str = ""):
    for k, v in RANK_ENV.items():
        os.environ.setdefault(k, v)  # inherited by the fork server, so by every rank
    _import_root_first()
    _safe_path()
    method = os.environ.get("TPDIAG_START_METHOD", "forkserver")
    if method not in mp.get_all_start_methods():
        from tpdiag.errors import BadInput

        raise BadInput(f"TPDIAG_START_METHOD={method!r}: expected one of {', '.join(mp.get_all_start_methods())}")
    ctx = mp.get_context(method)
    if method == "forkserver":
        # Ranks fork from a server that has imported torch once: start-up is ~0.1 s, not ~2 s.
        # (The server starts with the first world, so this is fixed for the process's life.)
        # an hf: model: transformers' model machinery too (modeling_utils, and scipy through its
        # losses: ~2 s of CPU), which every rank's build otherwise imported on its own
        extra = ["transformers", "transformers.modeling_utils", "transformers.models.auto.modeling_auto",
                 "tpdiag.models.hf", "tpdiag.models.hf_plan"] if model.startswith("hf:") else []
        ctx.set_forkserver_preload(_PRELOAD + extra)
    return ctx


def prestart(model: str = "") -> None:
    """Start the fork server now: its imports (torch, and transformers for an hf: model: seconds)
    then run while this process checks the input and resolves the model, instead of inside the
    first world's start. A no-op for another start method, a server already running, or
    TPDIAG_PRESTART=0 (A/B). If the input is bad, the server exits with this process."""
    if os.environ.get("TPDIAG_PRESTART", "1") == "0":
        return
    _server_context(model, start=True)


def _server_context(model: str, start: bool = False):
    """The ranks' start context; start: its fork server started now. RANK_ENV goes to the server
    (so to every rank) but not to this process: here torch is not imported yet, and
    OMP_NUM_THREADS=1 would make the diff, which runs here, single-threaded."""
    saved = _rank_vars()
    try:
        ctx = _context(model)
        if start and ctx.get_start_method() == "forkserver" and threading.current_thread() is threading.main_thread():
            from multiprocessing import forkserver

            forkserver.ensure_running()
        return ctx
    finally:
        _restore_env(saved)


def prewarm(device: str, degrees, dtype: str, model: str = "", cfg=None) -> None:
    """On GPUs, compile the record-hash kernels' usual variants in the background
    (runner/warm.py) while this process checks the input: a fresh machine's first world
    otherwise compiles them one after another. cfg (a CompareConfig): the fix GEMMs its worlds
    will run are warmed too (warm.gemm_spec). Processes left running exit by themselves."""
    from tpdiag.models.capacity import guess_device

    if guess_device(device, degrees) != "cuda" or os.environ.get("TPDIAG_PRESTART", "1") == "0":
        return  # without prestart the thread would start the fork server, outside the rank environment
    from tpdiag.runner import warm

    ctx = _server_context(model)

    def run():
        try:  # bad input (TPDIAG_TREE_GROUPS=x) is the checks' to report, in their one line
            gemm, first = warm.gemm_spec(cfg) if cfg is not None else (None, False)
        except Exception:  # noqa: BLE001 - a warm-up is never the run's failure
            gemm, first = None, False
        _WARM.extend(warm.start(ctx, [dtype, "float32"], gemm=gemm, gemm_first=first))

    # a process the fork server starts waits for the server's own imports (torch: seconds): from a
    # thread, so that those go on overlapping the checks (started inline, they added ~6 s to an
    # H200 compare's checks: 10.7 s -> 16.0-18.8 s)
    threading.Thread(target=run, daemon=True, name="tpdiag-prewarm").start()


_WARM: list = []


def drop_markers(folder: str) -> None:
    """A world folder made ready for a world: only the markers a rank writes (rankN.done,
    rankN.error) from an earlier run there are removed - any other file in tpN/ is not tpdiag's to
    delete."""
    os.makedirs(folder, exist_ok=True)
    for name in os.listdir(folder):
        if _MARKER.fullmatch(name) and not os.path.isdir(os.path.join(folder, name)):
            os.unlink(os.path.join(folder, name))


def _rank_vars() -> dict:
    """This process's own values of what _context sets for the ranks (None: unset), for _restore_env."""
    return {k: os.environ.get(k) for k in (*RANK_ENV, "PYTHONSAFEPATH", SAFE_PATH_MARK)}


def _restore_env(saved: dict) -> None:
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


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
        finally:
            _restore_env(saved)
    launched_at = time.time()
    procs = [ctx.Process(target=entry or worker.main, name=f"tpdiag-{folder(world)}-rank{r}",
                         args=(r, world, "127.0.0.1", store.port, cfg.to_dict(), timeout_s, os.getpid(),
                               launched_at), kwargs={"gpu_offset": gpu_offset} if gpu_offset else {})
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
