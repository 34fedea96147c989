"""The ranks' start: their environment (RANK_ENV, the import root, PYTHONSAFEPATH) and the fork
server they start from, with its preloaded imports - set for the ranks around their start and
restored after it, so the caller's own process keeps its environment (runner/launch.py starts them).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import sys
import threading

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


# Set for the fork server and the ranks (a spawned rank takes it at its start): a rank's start
# imports the launcher's main script again (multiprocessing's spawn.prepare, under forkserver and
# spawn), and a tpdiag call met there is that script's own call, unguarded - not a new run.
RANK_MARK = "TPDIAG_RANK_START"
# the exit status of such a rank (runner/launch.py names the cause to the caller from it)
RERAN_MAIN = 86


def refuse_rerun(starts: bool = True) -> None:
    """Called where tpdiag starts processes, and first thing in the APIs that may: while a process
    is importing its launcher's main script (multiprocessing's `_inheriting`), a call here is that
    script's unguarded call run again. A rank of tpdiag's leaves at once with RERAN_MAIN (before
    the call reads its input, builds a model or starts worlds of its own); another process (the
    caller's own spawned workers) gets the fix in one line where it would start processes (starts),
    which multiprocessing refuses there anyway - a TP=1-only rollout it may run as before."""
    if not getattr(mp.current_process(), "_inheriting", False):
        return
    if os.environ.get(RANK_MARK):
        os._exit(RERAN_MAIN)
    if starts:
        from tpdiag.errors import UnguardedMain

        raise UnguardedMain(unguarded_line())


def unguarded_line(who: str = "this process") -> str:
    main = getattr(sys.modules.get("__main__"), "__file__", None)
    script = os.path.basename(main) if main else "the main script"
    return (f"{who} ran {script} again as {'they' if who.endswith('ranks') else 'it'} started (Python's "
            f"{os.environ.get('TPDIAG_START_METHOD', 'forkserver')} start method imports the main script in "
            f"every new process), and its top-level code called tpdiag again: wrap the call in "
            f"`if __name__ == '__main__':`")


def _context(model: str = ""):
    refuse_rerun()
    os.environ[RANK_MARK] = "1"
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


def rank_entry(env: dict, entry, *args, **kwargs) -> None:
    """A rank's start: the launcher's environment as this world starts, then `entry`. A fork
    server's child inherits the server's environment, fixed at its start with the process's first
    world; a variable the caller set after it (a user's model file reading its checkpoint's path
    from os.environ, set by a notebook or a test between two runs) reached no rank of a later world,
    whose build then failed. As with spawn or fork, a rank now sees what its launcher sees (set or
    changed variables; the server's own imports keep what they read at its start)."""
    os.environ.update(env)
    os.environ.pop(RANK_MARK, None)  # the rank's own code (a user's model) is no longer a rank's start
    entry(*args, **kwargs)


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


def _rank_vars() -> dict:
    """This process's own values of what _context sets for the ranks (None: unset), for _restore_env."""
    return {k: os.environ.get(k) for k in (*RANK_ENV, "PYTHONSAFEPATH", SAFE_PATH_MARK, RANK_MARK)}


def _restore_env(saved: dict) -> None:
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
