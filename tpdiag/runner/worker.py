"""Entry point of one rank. Writes its completion marker only after all its work is on disk.

A world's result is complete when every rank wrote `rankR.done` - not when every exit code is
0: on torch 2.13 + gloo a rank can abort at teardown after finishing its work.
"""
from __future__ import annotations

import os
import sys
import time
import traceback
from datetime import timedelta

from tpdiag.runner.rank_exit import leave
from tpdiag.runner.reference_shapes import _piece_ref, _ref_shapes, _reference_params


def marker(out_dir: str, rank: int, what: str) -> str:
    return os.path.join(out_dir, f"rank{rank}.{what}")


def main(rank: int, world: int, host: str, port: int, cfg_dict: dict, timeout_s: float,
         launcher_pid: int | None = None, launched_at: float | None = None, gpu_offset: int = 0) -> None:
    """`launched_at`: the launcher's time.time() when it started the world's ranks. `gpu_offset`:
    rank R runs on GPU R + gpu_offset (a TP=1 world beside another, runner/side_by_side.py)."""
    entered = time.time()
    if os.environ.pop("TPDIAG_SET_PYTHONSAFEPATH", None):
        os.environ.pop("PYTHONSAFEPATH", None)  # start_context._safe_path's, for the fork server only
    from tpdiag.base import files as io
    from tpdiag.config import WorldConfig

    _watch_launcher(launcher_pid)
    cfg = WorldConfig.from_dict(cfg_dict)
    from tpdiag.runner.meta_memo import group_of, rank_memo

    memo = rank_memo(launcher_pid, group_of(cfg.settings))
    os.environ["TPDIAG_RANK"] = str(rank)
    # every rank of a world runs on this host: full capture's default host budget is shared
    os.environ.setdefault("TPDIAG_LOCAL_RANKS", str(world))
    try:
        from tpdiag.runner.compile_time import compile_meter

        with compile_meter(cfg.device) as compiled:  # Triton's JIT compiles, wherever they fall
            timings = _profiled(rank, cfg.label, _run, rank, world, host, port, cfg, timeout_s,
                                entered, launched_at, gpu_offset)
        timings.update(compiled)
        if memo is not None:  # before the marker: the launcher's next world reads it
            memo.save()
        # the rank's phase timings travel in its marker: the launcher collects every rank's
        numerics = timings.pop("numerics", None)
        io.write_json(marker(cfg.out_dir, rank, "done"), {"rank": rank, "time": time.time(),
                                                          "timings": timings, "numerics": numerics})
    except BaseException as e:  # noqa: BLE001 - every failure must leave evidence on disk
        message = str(e).splitlines()[0] if str(e) else ""
        if "does not have a deterministic implementation" in message:
            message = (message.split(", but you set")[0] + " in deterministic mode; to run it "
                       "anyway (its results may then differ run to run) set TPDIAG_DETERMINISM=warn")
        try:
            from tpdiag.runner.rank_errors import library_where, mixed_hint, user_frame

            message = mixed_hint(message)
            where, model_where = user_frame(e), None
            if where is None:
                message, model_where = library_where(e, message)
            io.write_json(marker(cfg.out_dir, rank, "error"), {
                "rank": rank, "type": type(e).__name__, "message": message,
                "where": where, "model_where": model_where, "traceback": traceback.format_exc(),
            })
        except BaseException as e2:  # noqa: BLE001 - disk full or gone: one line, no traceback
            sys.stderr.write(f"tpdiag: rank {rank} of TP={world}: {type(e).__name__}: {message} "
                             f"(its error marker could not be written: {e2})\n")
        leave(1)
    leave(0)  # no interpreter teardown (tpdiag.runner.rank_exit)


def _watch_launcher(pid: int | None) -> None:
    """Exit as soon as the process that launched this world is gone (killed with SIGKILL,
    crashed, or interrupted while starting this rank, before it learned the rank's pid).

    Not the parent: ranks are children of the fork server, and every rank holds the fork
    server's 'alive' pipe, so the server outlives the launcher for as long as any rank lives.
    A daemon thread polls the launcher's /proc entry (start time included: pids are reused)."""
    import signal
    import threading

    # The launcher blocks SIGINT/SIGTERM while it starts a rank; a rank forked then inherits that.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
    if not pid:
        return
    born = _start_time(pid)
    if born is None:  # gone before this rank even started
        os._exit(1)

    def watch():
        while True:
            time.sleep(0.5)
            if _start_time(pid) != born:
                os._exit(1)

    threading.Thread(target=watch, name="tpdiag-launcher-watch", daemon=True).start()


def _start_time(pid: int):
    """The process's start time (None: gone or a zombie); without /proc, whether it exists."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        return None if fields[0] in ("Z", "X") else fields[19]
    except FileNotFoundError:
        return None
    except OSError:
        try:
            os.kill(pid, 0)
            return "alive"
        except ProcessLookupError:
            return None
        except OSError:
            return "alive"


def _run(rank: int, world: int, host: str, port: int, cfg, timeout_s: float,
         entered: float | None = None, launched_at: float | None = None, gpu_offset: int = 0) -> dict:
    """This rank's work; returns its per-phase wall times (s) and peak memory (bytes)."""
    import torch
    import torch.distributed as dist

    from tpdiag.records import store
    from tpdiag.probes.recorder import Recorder
    from tpdiag.probes.stream import close_stores
    from tpdiag.runner import determinism
    from tpdiag.runner.gather import gather_records
    from tpdiag.runner.step import build, run

    determinism.setup(cfg.seed, cfg.device, cfg.flags)
    if cfg.device == "cuda":
        torch.cuda.set_device(rank + gpu_offset)
        device = torch.device("cuda", rank + gpu_offset)
        frac = os.environ.get("TPDIAG_CUDA_MEM_FRACTION")  # fault injection: a real OOM on a big GPU
        if frac:
            torch.cuda.set_per_process_memory_fraction(float(frac), device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    tcp = dist.TCPStore(host, port, world_size=world + 1, is_master=False,
                        timeout=timedelta(seconds=timeout_s))
    t_pg = time.perf_counter()
    dist.init_process_group(backend, store=tcp, rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s),
                            **({"device_id": device} if backend == "nccl" else {}))
    phases = {"process_group_s": time.perf_counter() - t_pg}
    if entered is not None:  # imports, determinism settings, rendezvous store
        phases["setup_s"] = time.time() - entered - phases["process_group_s"]
    _fault_injection(rank, world)
    t0 = time.perf_counter()
    selfcheck = None
    from tpdiag.runner.decode import DECODE_SELFCHECK_CALLS

    # a decode rerun of the first positions (runner/prefix.py) has no step of pass 1's to match
    # its fingerprint with: it proves its own probes inert (a prompt call and 16 one-token calls)
    check = cfg.rerun.selfcheck or bool(cfg.rerun.positions and cfg.mode == "decode")
    decode_calls = DECODE_SELFCHECK_CALLS if check and cfg.mode == "decode" else 0
    ref_shapes = _ref_shapes(cfg, world)
    piece_ref = _piece_ref(cfg)
    first_run = time.time()
    built = None
    if check:
        # The same step with no probes: what the model computes when nobody watches. One build
        # for both runs: the probed run starts from the build's own bits, put back (pristine.py)
        from tpdiag.runner.pristine import Pristine

        built = build(cfg, device, world)
        t_copy = time.perf_counter()
        kept = Pristine.take(built[1])
        from tpdiag.base.user_state import put_back, take

        # the user's globals too (a call counter in their model's file): no rebuild resets them
        # (the modules' own attributes are Pristine's: restored, or the model rebuilt)
        kept_py = take(built[1].modules(), attrs=False)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        phases["selfcheck_copy_s"] = time.perf_counter() - t_copy  # inside selfcheck_s
        bare = Recorder(ref_shapes=ref_shapes, spill_dir=_spill(cfg, rank, "bare"), piece_ref=piece_ref)
        # a decode world's unprobed run: the prompt call and the first DECODE_SELFCHECK_CALLS
        # one-token calls, not all of them (at 1 x 2048 the whole was 26 s of a 85 s world)
        bare_t = run(cfg.with_(probes=False), device, world, bare, decode_check=decode_calls,
                     decode_only_check=True, built=built)
        phases["selfcheck_s"] = time.perf_counter() - t0
        phases["selfcheck_model_s"] = bare_t["model_s"]  # the world's build, inside selfcheck_s
        first_built = first_run + bare_t["model_s"]
        if device.type == "cuda":
            phases["selfcheck_peak_mem_bytes"] = torch.cuda.max_memory_allocated(device)
        built, why = _reuse(built, kept, device)
        put_back(kept_py)
        del kept_py
        if why:  # the probed run builds its own, as a rebuild gives what a restore could not
            phases["selfcheck_rebuilt"] = why
        del kept
    rec = Recorder(ref_shapes=ref_shapes, spill_dir=_spill(cfg, rank, "rec"), piece_ref=piece_ref,
                   only_kinds=store.OWN_KINDS if cfg.records_base else None)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    probed_run = time.time()
    timings = run(cfg, device, world, rec, fingerprint=True, decode_check=decode_calls, built=built)
    del built
    if not check:
        first_built = probed_run + timings["model_s"]
    if device.type == "cuda":
        timings["peak_mem_bytes"] = torch.cuda.max_memory_allocated(device)
    fingerprint = [rec.fingerprint]
    if world > 1:
        fingerprint = [None] * world
        dist.all_gather_object(fingerprint, rec.fingerprint)
    if cfg.rerun.oracle or cfg.rerun.oracle_ops:  # float64 re-executions, inside steps_s
        timings["float64_s"] = rec.oracle_s
    if rec.piece_varying:  # decode calls' records left out as they grew (probes/pieces.grows)
        timings["piece_records_left_out"] = sum(rec.piece_varying.values())
    if rec.host_store is not None:  # full capture: bytes captured, copied once, spilled
        timings["host"] = dict(rec.host_store.stats)
    if check:
        selfcheck = _probe_selfcheck(bare, rec, device)
        close_stores(bare.records)
    t1 = time.perf_counter()
    stored = gather_records(rec.records, device, lanes=rec.lanes, hashbuf=rec.hashbuf, stream=True,
                            per_rank=_reference_params(cfg) if rec.per_rank_params else None,
                            spill_dir=_spill(cfg, rank, "out"))
    timings["gather_s"] = time.perf_counter() - t1
    # spawned -> process group -> first model built, initialised and sharded
    start = launched_at if launched_at is not None else entered
    if start is not None:
        timings["world_start_s"] = first_built - start
        if launched_at is not None and entered is not None:
            timings["spawn_s"] = entered - launched_at
    timings.update(phases)
    if rank == 0:
        store.write(cfg.out_dir, stored, {
            "degree": world, "label": cfg.label, "backend": backend, "device": str(device),
            "config": cfg.to_dict(), "timings": timings, "n_records": len(stored),
            "capture": rec.mode,
            "probe_selfcheck": selfcheck,
            "fingerprint": fingerprint,
            # float64 re-executions refused (probes/float64.py): record key -> why
            "oracle_notes": rec.oracle_notes,
            # ... and from another world's own inputs (the own-input pass): label -> record key -> notes
            **({"oracle_notes_own": rec.oracle_notes_own} if rec.oracle_notes_own else {}),
            # ... and each re-executed call's notes name the other modules' buffers it read
            # (notes["reads"]): a call re-executed without such a note read none
            # (diff/written_state.read_after)
            "oracle_reads_noted": True,
            # how many parameters are no replica (runner/per_rank.py): where some are, this world's gather
            # reads the reference's index, so a later pass never runs it beside its reference
            # (runner/side_by_side.pair_gpu)
            "per_rank_params": int(rec.per_rank_params or 0),
            # the tied weights the plan split (models/ties.py), read by the diff (diff/analyse.py)
            **({"ties_broken": rec.ties_broken} if rec.ties_broken else {}),
            # the user's grad hooks the plan dropped with the parameters it replaced (models/grad_hooks.py)
            **({"hooks_dropped": rec.hooks_dropped} if rec.hooks_dropped else {}),
            # ... and, where they run (TP=1), whether they changed the grad
            **({"hook_effect": dict(sorted(rec.hook_effect.items()))} if rec.hook_effect else {}),
            # ... and, where the plan ran (TP > 1), the parameters whose hooks it kept
            **({"hooks_kept": rec.hooks_kept} if rec.hooks_kept else {}),
            # weights the fixes' carry left the stock grad (user grad hooks, computed weights)
            **({"not_carried": dict(sorted(rec.not_carried.items()))} if rec.not_carried else {}),
            # step -> buffers a micro-batch wrote before a later one of the step read them
            **({"piece_state": rec.piece_state} if rec.piece_state else {}),
            # the later steps re-anchored at the reference's state (runner/anchor.py; diff/anchored.py)
            **({"anchor": rec.anchor} if rec.anchor is not None else {}),
            **({"vocab_padding": rec.vocab_padding} if rec.vocab_padding else {}),
            "total_s": time.perf_counter() - t0,
        })
        timings["write_s"] = time.perf_counter() - t1 - timings["gather_s"]
    close_stores(rec.records, stored or [])
    dist.barrier()
    timings["max_rss_bytes"] = _max_rss_bytes()
    return timings


def _reuse(built: tuple, kept, device) -> tuple:
    """(built for the probed run or None, why not): the model the unprobed run used, its built
    state restored - model_s is then the restore's seconds - or None to build anew."""
    t0 = time.perf_counter()
    why = kept if isinstance(kept, str) else kept.restore()
    if why:
        return None, why
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)
    return (built[0], built[1], time.perf_counter() - t0), None


def _profiled(rank: int, label: str, fn, *args):
    """Developer hook: TPDIAG_PROFILE_DIR=D writes rank 0's host profile of each world (cProfile,
    D/<label>.prof; `python -m pstats`) - where a world's host time goes, on any machine."""
    where = os.environ.get("TPDIAG_PROFILE_DIR")
    if not where or rank != 0:
        return fn(*args)
    import cProfile
    import re

    os.makedirs(where, exist_ok=True)
    prof = cProfile.Profile()
    try:
        return prof.runcall(fn, *args)
    finally:
        label = re.sub(r"[^A-Za-z0-9_.-]", "_", label)
        path, n = os.path.join(where, f"{label}.prof"), 1
        while os.path.exists(path):  # a second pass's world of the same label
            n += 1
            path = os.path.join(where, f"{label}.{n}.prof")
        prof.dump_stats(path)


def _max_rss_bytes() -> int:
    """This rank's peak resident host memory (pages shared with the fork server included)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _spill(cfg, rank: int, what: str) -> str:
    """Where full capture spills records past the host budget: inside the degree's directory,
    removed once the records are written."""
    return os.path.join(cfg.out_dir, f".spill-rank{rank}-{what}")


def _probe_selfcheck(bare, probed, device) -> dict:
    """Final logits, logprobs, loss, grad norm and updated params, probes on vs off, bitwise,
    on every rank (local shards); the verdict is the AND over ranks."""
    import torch
    import torch.distributed as dist

    from tpdiag.diff.bits import bitwise_equal
    from tpdiag.probes.hash_place import is_stale, take_lanes
    from tpdiag.probes.stream import as_tensor

    kinds = {"logits", "logprobs", "loss", "grad_norm", "param"}

    def values(r):
        # hash mode keeps no tensor: its integer lanes (exact; the float sums are not) stand for it
        rows = [s for s in r.lanes if s is not None]
        ints = dict(zip(rows, take_lanes(r.hashbuf, rows)[0])) if rows else {}
        # a stale row (changed in place before its queued hash) proves nothing: left out, so
        # its key counts as a mismatch (take() flushed the queue: the stale list is complete)
        stale = set(r.hashbuf.stale) if rows else set()
        return {m["key"]: (as_tensor(t) if t is not None else ints[slot])
                for (m, t), slot in zip(r.records, r.lanes)
                if m["kind"] in kinds and not is_stale(slot, stale)}

    extra = {}
    if bare.decode_check is not None:
        # a decode world: the unprobed run made only the prompt call and the first few one-token
        # calls (the same calls, the same shapes as the probed run's first ones): their logits
        n = bare.decode_check[0]
        bad = [] if probed.decode_check == bare.decode_check else [f"logits of positions 0..{n - 1}"]
        # the probed run's hash of those logits: a rerun of the first positions (runner/prefix.py)
        # is checked against it, pass to pass
        checked, extra = 1, {"positions": n, "logits_hash": probed.decode_check[1] if probed.decode_check else None}
    else:
        want, have = values(bare), values(probed)
        bad = sorted(k for k in want if k not in have or not bitwise_equal(want[k], have[k]))
        checked = len(want)
    flag = torch.tensor([0 if bad else 1], dtype=torch.int32, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return {"equal": bool(flag.item()), "checked": checked, "first_mismatch": bad[0] if bad else None,
            **extra}


def _fault_injection(rank: int, world: int) -> None:
    """Test hook: TPDIAG_FAULT='raise:R@N' ('exit', 'hang') breaks rank R of the TP=N world."""
    spec = os.environ.get("TPDIAG_FAULT", "")
    if not spec:
        return
    what, _, where = spec.partition(":")
    r, _, n = where.partition("@")
    if (r and int(r) != rank) or (n and int(n) != world):
        return
    if what == "raise":
        raise RuntimeError(f"injected fault on rank {rank}")
    if what == "exit":
        os._exit(7)
    if what == "hang":
        time.sleep(10_000)
