"""Small helpers the probes jobs share."""
from __future__ import annotations

import os
from contextlib import contextmanager


def seconds(fn, rep: int) -> float:
    """Median seconds of fn (triton.testing.do_bench, L2 flushed per rep)."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=rep) / 1e3


# PROBES_BASE_KERNEL: a record_hash_triton.py of another commit (`git show REV:tpdiag/kernels/
# record_hash_triton.py > FILE`), timed side by side with this tree's kernel - `probes hash`'s
# "base kernel" rows and `probes overhead`'s hash-base mode. Its launches use 7a273bb's register
# caps (_base_narrow_regs; a base of another commit may have had other caps) and a direct-launch
# cache of their own. Since 07e5b36 the kernel file imports one tile's arithmetic from
# tpdiag/kernels/record_hash_tile.py, which comes from the tree that runs: a base of that commit
# or later times its own chunk walk with this tree's tile code (an older base is one whole file).
BASE_KERNEL_ENV = "PROBES_BASE_KERNEL"
_BASE: dict = {}


def _base_narrow_regs(row_iters, width: int, pairs: bool):
    """record_hash.narrow_regs as of 7a273bb: 96 for 32-bit narrow tiles and 16-bit dense word
    pairs."""
    if not row_iters or (width == 16 and not (row_iters == 2 and pairs)):
        return None
    return 96


def base_kernel_path() -> str | None:
    p = os.environ.get(BASE_KERNEL_ENV, "").strip()
    if p and not os.path.isfile(p):
        raise SystemExit(f"{BASE_KERNEL_ENV}={p!r}: no such file")
    return p or None


@contextmanager
def base_kernel(path: str, launch: bool = True):
    """record_hash's launches use the kernels of `path` inside the block (launch=False: compiled
    only, as `probes sass` does - any age of kernel)."""
    import importlib.util

    from tpdiag.kernels import record_hash as rh

    if path not in _BASE:
        spec = importlib.util.spec_from_file_location("_probes_base_record_hash_triton", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        _BASE[path] = (mod, {})
    mod, cache = _BASE[path]
    if launch and "BLK" not in mod._hash_kernel.arg_names:
        # this tree's launches pass BLK and no R / CB / EVEN (since 58bc672): an older kernel
        # file cannot take them - time that commit in a run of its own instead
        raise SystemExit(f"{BASE_KERNEL_ENV}={path!r}: a kernel from before 58bc672 (constexprs R, CB, EVEN); "
                         "run `probes hash` at that commit instead")
    saved = rh._triton, rh._COMPILED, rh.narrow_regs
    try:
        rh._triton, rh._COMPILED, rh.narrow_regs = (lambda: mod), cache, _base_narrow_regs
        yield
    finally:
        rh._triton, rh._COMPILED, rh.narrow_regs = saved


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


@contextmanager
def probe_mode(mode: str):
    """What a probes mode runs under, undone on exit (the jobs run the modes side by side in one
    process): hash-each / hash-jit a launch per record (hash-jit through Triton's JIT dispatch);
    hash-cap256m a launch per 256 MiB queued; hash-batchN a launch per N records; hash-wavesN
    16-bit records at N programs per SM (a record, whatever the launch); hash-pairs[N] bf16 read
    as 32-bit word pairs [at N programs per SM]; hash-elem[N] bf16 element by element at N (4)
    programs per SM - the 16-bit path shipped before 62cadff's lean word pairs; hash-itersN 16-bit chunks of N tiles (not 16); hash-hooks every module
    probed through hooks (TPDIAG_PROBE_HOOKS=1); hooks-only Recorder.add returning at once and
    rows-only the records made with nothing queued or hashed (hash mode's host time by removal);
    hash-side, an experiment, the queued launches on a second stream beside the compute - what
    overlap could win at most, its hashes not to be trusted (a queued tensor may be freed, reused
    or changed in place before that stream reads it); wrap-only, an experiment, every module's
    forward wrapped in a pass-through and nothing else (no records, no grad hooks): what the
    wrapping alone costs; hash-reghook every output's grad hook through Tensor.register_hook (before
    session 18's taps); hash-base the kernels of PROBES_BASE_KERNEL (another commit's record_hash_triton.py).
    Other modes: nothing changed."""
    from tpdiag.kernels import record_hash as rh
    from tpdiag.kernels import record_hash_batch as rb
    from tpdiag.kernels.hash_buffer import _ENTRIES as hb_entries
    from tpdiag.kernels.hash_buffer import HashBuffer
    from tpdiag.probes import module_probe
    from tpdiag.probes.recorder import Recorder

    knobs = ("TPDIAG_HASH_BATCH", "TPDIAG_HASH_CAP_MB", "TPDIAG_PROBE_HOOKS", "TPDIAG_PROBE_TAPS")
    saved = (Recorder.add, HashBuffer.add, HashBuffer.add_whole, rb.batch_launch, rh._FAST[0],
             {k: os.environ.get(k) for k in knobs}, module_probe.module_probes, rh.PAIRS[0],
             list(rh._WAVES_2BYTE), rh.ITERS_2BYTE, HashBuffer.add_span)
    try:
        rh._FAST[0] = mode != "hash-jit"
        if mode in ("hash-each", "hash-jit"):
            os.environ["TPDIAG_HASH_BATCH"] = "1"
        if mode.startswith("hash-batch"):  # hash-batchN: N records per launch (default 64)
            os.environ["TPDIAG_HASH_BATCH"] = mode[len("hash-batch"):]
        if mode.startswith("hash-pairs"):  # hash-pairs[N]: bf16 as word pairs (at N programs per SM)
            rh.PAIRS[0] = True
        if mode.startswith("hash-elem"):  # hash-elem[N]: bf16 element by element, at N (4) per SM
            rh.PAIRS[0] = False
            rh._WAVES_2BYTE[:] = [int(mode[9:] or 4)] * 2
        if mode.startswith(("hash-waves", "hash-pairs")) and mode[10:].isdigit():  # hash-wavesN
            rh._WAVES_2BYTE[:] = [int(mode[10:])] * 2  # N a record, whatever the launch
        if mode.startswith("hash-iters") and mode[10:].isdigit():  # hash-itersN: 16-bit chunks of N tiles
            rh.ITERS_2BYTE = int(mode[10:])
        if rh.ITERS_2BYTE != saved[9]:
            # launch plans depend on the chunk length: planned afresh for this mode (a plan's key
            # carries its chunk length, so a stale one would hash right, as the mode before it
            # did). Only then: other modes keep the caches a step's host time relies on.
            rb._ENTRY.clear()
            hb_entries.clear()
        if mode == "hash-hooks":  # every module probed through hooks (before session 13)
            os.environ["TPDIAG_PROBE_HOOKS"] = "1"
        if mode == "hash-reghook":  # output grads hooked by Tensor.register_hook (before session 18)
            os.environ["TPDIAG_PROBE_TAPS"] = "0"
        if mode == "hash-cap256m":  # the default until session 12 (now 1 GiB)
            os.environ["TPDIAG_HASH_CAP_MB"] = "256"
        if mode == "hash-side":
            rb.batch_launch = _side_launch(rb.batch_launch)
        if mode in ("hooks-only", "wrap-only"):
            Recorder.add = _no_add
        if mode == "wrap-only":
            module_probe.module_probes = _wrap_only
        if mode == "rows-only":
            HashBuffer.add = HashBuffer.add_whole = HashBuffer.add_span = _no_hash
        if mode == "hash-base":  # the kernels of PROBES_BASE_KERNEL (another commit's), A/B
            path = base_kernel_path()
            if path is None:
                raise SystemExit(f"mode hash-base needs {BASE_KERNEL_ENV}=FILE")
            with base_kernel(path):
                yield
            return
        yield
    finally:
        Recorder.add, HashBuffer.add, HashBuffer.add_whole, rb.batch_launch, rh._FAST[0] = saved[:5]
        HashBuffer.add_span = saved[10]
        changed = rh.ITERS_2BYTE != saved[9]
        module_probe.module_probes, rh.PAIRS[0], rh._WAVES_2BYTE[:], rh.ITERS_2BYTE = saved[6:10]
        if changed:
            rb._ENTRY.clear()
            hb_entries.clear()
        for k, v in saved[5].items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextmanager
def _wrap_only(model, rec, **_):
    from tpdiag.probes.module_probe import _unwrap, _wrap_forward

    wrapped: list = []
    nothing = lambda *a: None  # noqa: E731
    try:
        for m in model.modules():
            _wrap_forward(m, nothing, nothing, wrapped)
        yield rec
    finally:
        _unwrap(wrapped)


def _no_add(self, *a, **k):
    return None


def _no_hash(self, t, *a, **k) -> int:
    import torch

    n = self.n
    if n // self.CHUNK == len(self.ints):  # rows to read back, zero
        self.ints.append(torch.zeros((self.CHUNK, 4), dtype=torch.int64, device=self.device))
        self.floats.append(torch.zeros((self.CHUNK, 2), dtype=torch.float64, device=self.device))
    self.n = n + 1
    return n


def _side_launch(launch):
    import torch

    side: list = []

    def run(key, table, n, nprog, ints, floats, **kw):
        if not side:
            side.append(torch.cuda.Stream(device=ints.device))
        side[0].wait_stream(torch.cuda.current_stream(ints.device))
        with torch.cuda.stream(side[0]):
            launch(key, table, n, nprog, ints, floats, **kw)

    return run


def host_model(cuda: bool, what: str):
    """The host-time jobs' model (probes host, probes decode-host): llama-1b's module structure
    (16 layers, the same modules and records) at tiny widths, fp32, one torch thread, built once
    and handed to tpdiag's step (step.build_model). On CPU hash mode's records are queued as on
    CUDA (HashBuffer, batch_entry, launch tables) but the launch does nothing: host work only.
    Returns the device."""
    import torch

    from tpdiag.kernels import record_hash as rh
    from tpdiag.kernels import record_hash_batch as rb
    from tpdiag.models import tiny_llama
    from tpdiag.models.plans import llama_plan
    from tpdiag.models.target import Target
    from tpdiag.runner import determinism, step

    if cuda:
        from benchmarks.errors import require_cuda

        require_cuda(what)
    determinism.setup(0, "cuda" if cuda else "cpu")
    # one thread: the step's CPU time is then this thread's work, which other processes on a
    # shared host disturb far less than wall time
    torch.set_num_threads(1)
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    torch.manual_seed(0)
    model = tiny_llama.build("llama-1b", dim=64, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=512).to(dev)
    target = Target(model=model, plan=llama_plan("stock"), vocab_size=512, divisors=model.cfg.divisors())
    step.build_model = lambda cfg, device, world: (target, model)
    if not cuda:
        rh.triton_ok = lambda t: type(t) is torch.Tensor and t.dtype in rh._TRITON_T and t.numel() > 0
        rb.batch_launch = lambda *a, **k: None
        # the few records kept whole (batch, logprobs, loss, grad norm) hash at once: the torch path
        rh.triton_lanes = lambda t, a, L, b, F, o, out=None, **k: rh.lanes_torch(t, a, L, b, F, o, out)
    return dev


def profiled_medians(once, times: dict, sort: str):
    """One more hash-mode run under cProfile (its top functions as text, sorted by `sort`) and
    the rounds' medians and spreads per mode: the host-time jobs' common tail."""
    import cProfile
    import io
    import pstats
    import statistics

    prof = cProfile.Profile()
    prof.enable()
    once("hash")
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats(sort).print_stats(25)
    med = {m: statistics.median(v) for m, v in times.items()}
    spread = {m: max(v) - min(v) for m, v in times.items()}
    return s.getvalue(), med, spread
