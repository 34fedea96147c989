"""In-process capture: `with tpdiag.capture(model, out=DIR) as cap:` around your own step.

For models tpdiag cannot build (Megatron, NeMo, torchtitan, an RL trainer), under your own
launcher (torchrun, SLURM, several nodes). The same probes as `tpdiag compare` record every
module's inputs, outputs and gradients; on exit the shards go to the TP group's rank 0 in one
collective and DIR gets exactly the layout of a compare's `tp{N}/` directory (events.jsonl,
records.safetensors, world.json) plus manifest.json, written last, whose model fingerprint
lets `tpdiag diff RUN_A RUN_B` refuse captures that cannot be compared.

    with tpdiag.capture(model, out="runs/tp2", plan=plan, seed=1234) as cap:
        cap.batch(input_ids=ids, labels=labels)
        logits = model(ids)
        cap.logprobs(token_logprobs)
        loss = loss_fn(logits, labels); cap.loss(loss)
        loss.backward(); opt.step()
        cap.params()          # parameters after the optimizer step

The probes only observe (no tensor replaced, no autograd node added): the step computes the
same bits with and without the capture.
"""
from __future__ import annotations

import os
import sys
import time
import types
from collections import Counter
from contextlib import ExitStack

import torch

from tpdiag.api.capture_layouts import (apply_layouts, check_layout, collective_device, fingerprint, group_of,
                                        included, plan_label, records_here, style_plan)
from tpdiag.errors import BadInput

SCHEMA = 1
TOOL = "tpdiag.capture"
from tpdiag.records.paths import MANIFEST  # noqa: E402,F401 - a capture's manifest, the run directory's name

def capture(model: torch.nn.Module, out: str, plan: dict | None = None,
            layouts: dict[str, str] | None = None, *, group=None, seed: int | None = None,
            modules: list[str] | None = None, backward: bool = True,
            params: bool = True, oracle: bool | list[str] | None = None,
            optimizer: bool = True) -> "Capture":
    """Record `model` while the `with` block runs; write the capture to `out` on exit.

    plan     {fqn glob: ParallelStyle or style name ('colwise', 'rowwise', transformers'
             names)}: labels the layouts for cause classification. Pass what you sharded with.
    layouts  {glob: 'shard:D' | 'replicate'} for plain tensors with no DTensor placement: a glob
             matches a module name (its outputs and their grads) or 'module.param' (a param).
             Unlisted plain shards are inferred from the shape against the reference.
    group    the TP group: None (the default group), a ProcessGroup or a 1-D DeviceMesh. Only
             the TP group that holds global rank 0 records; other ranks run unprobed.
    seed     the seed your weights and batch came from (checked by `tpdiag diff`).
    modules  globs of module names to probe (default: all); params: record parameters.
    oracle   True, or globs of module names: each call of those modules is also re-executed in
             float64 from its own inputs (as compare's second pass does), so that `tpdiag diff`
             can tell a wrong result from rounding where no layout bound judges the first
             divergence (a module's own forward code: a norm, attention, hand-written
             collectives). Read from the reference capture (RUN_A) only; it costs a float64
             forward and backward per call of each module named. Without it such a first
             divergence is not judged and `tpdiag gate` exits 2 naming the module to pass here.
    optimizer  record what each torch.optim optimizer stepped inside the block consumed (the
             grads after your clip, its state, class and hyper-parameters: probes/optim_step.py),
             so that `tpdiag diff` can bound the parameters after your step; False: not
             recorded, and a parameter that moved in the step is not judged.
    """
    return Capture(model, out, plan=plan, layouts=layouts, group=group, seed=seed,
                   modules=modules, backward=backward, params=params, oracle=oracle,
                   optimizer=optimizer)


class Capture:
    def __init__(self, model, out, *, plan=None, layouts=None, group=None, seed=None,
                 modules=None, backward=True, params=True, oracle=None, optimizer=True):
        if not isinstance(model, torch.nn.Module):
            raise BadInput(f"capture(model=...): expected a torch.nn.Module, got {type(model).__name__}")
        if not out:
            raise BadInput("capture(out=...): a run directory is required")
        self.model, self.out = model, str(out)
        self.raw_plan = dict(plan or {})
        self.plan = style_plan(plan or {})
        self.layouts = {k: check_layout(k, v) for k, v in (layouts or {}).items()}
        self.group = group_of(group)
        self.seed, self.backward, self.with_params = seed, backward, params
        self.module_globs = list(modules) if modules else None
        self.oracle_globs = _oracle_globs(oracle)
        self.watch_optimizer = bool(optimizer)
        self.optimizer_steps: list = []
        self.rec = None
        self._stack: ExitStack | None = None
        self.active = False
        self._used = False

    # -- the with block --------------------------------------------------------------------
    def __enter__(self) -> "Capture":
        import torch.distributed as dist

        if self._used:
            # A second `with` on one capture would write over the first one's records in `out`.
            raise BadInput(f"capture(out={self.out!r}) was already entered once; make a new "
                           "tpdiag.capture(...) (with another out=) for each block to record")
        self._used = True
        self.active = records_here(self.group)
        if not self.active:
            return self
        self.degree = dist.get_world_size(self.group) if dist.is_initialized() else 1
        self.group_rank = dist.get_rank(self.group) if dist.is_initialized() else 0
        self._check_plan()
        from tpdiag.records.run_files import check_out

        # every rank, as the plan check: a compare run in DIR would lose its manifest below
        check_out(self.out, TOOL, "capture(out=...)")
        self._lock = ExitStack()
        try:
            if self.group_rank == 0:
                # One writer per DIR, as compare holds its --out: two jobs capturing into one DIR at once
                # (a script started twice) would leave one's world.json over the other's records, each
                # file whole (red team hred11). The flock goes with the process, however it ends.
                from tpdiag.records.lock import hold

                self._lock.enter_context(hold(self.out, "capture", unlockable_ok=True))
                # An earlier capture in DIR must not pass for this one if this one is interrupted.
                try:
                    os.unlink(os.path.join(self.out, MANIFEST))
                except FileNotFoundError:
                    pass
            self._enter_probes()
        except BaseException:
            self._lock.close()
            raise
        return self

    def _enter_probes(self) -> None:
        from tpdiag.probes.module_probe import module_probes
        from tpdiag.probes.model_walk import record_params
        from tpdiag.probes.recorder import Recorder

        self.fingerprint = fingerprint(self.model, self.layouts, self.degree)
        from tpdiag.models.grad_hooks import dtensor_names, hook_names

        # the grad hooks on the parameters as handed over: a hook the user put on a weight before
        # their own parallelize_module is not on the DTensor parameter the plan put in its place
        # (tpdiag never sees the model before the plan: diff/dropped_hooks.lost_at compares captures)
        self._hooks = {"param_hooks": hook_names(self.model), "dtensor_params": dtensor_names(self.model)}
        # full capture streams records to the host; past the budget they spill here (removed at exit)
        self.rec = Recorder(spill_dir=os.path.join(self.out, f".spill-rank{self.group_rank}"))
        self.t0 = time.perf_counter()
        self._stack = ExitStack()
        include = included(self.model, self.module_globs)
        oracle = None
        if self.oracle_globs:
            # the modules re-executed in float64, among those probed (an oracle record beside no
            # recorded output would judge nothing)
            oracle = included(self.model, self.oracle_globs)
            if not oracle:
                raise BadInput(f"capture(oracle={self.oracle_globs!r}): matches no module of the captured "
                               f"{type(self.model).__name__} (names as model.named_modules() gives them)")
            oracle = oracle & include if include is not None else oracle
        self._stack.enter_context(module_probes(self.model, self.rec, plan=self.plan,
                                                backward=self.backward, include=include,
                                                oracle=oracle or None))
        if self.with_params:
            record_params(self.rec, self.model, "param_init", self.plan)
        if self.watch_optimizer and self.with_params:
            from tpdiag.probes.model_walk import _style_memo
            from tpdiag.probes.optim_step import watch_optimizers

            self._stack.enter_context(watch_optimizers(self.model, self.rec, _style_memo(self.plan),
                                                       self.optimizer_steps, tp_group=self.group))
        self.rec.phase = "forward"

    def _check_plan(self) -> None:
        """compare's pre-launch plan checks (models/precheck.py), before anything is recorded:
        every rank raises the same one-line BadInput, so no peer waits in a collective."""
        from tpdiag.models.precheck import check_model_plan

        # the raw keys (a style name tpdiag has no label for still names a module), the
        # torch styles where known (they say which dimension is split)
        check_model_plan(self.model, {**self.raw_plan, **self.plan}, [self.degree],
                         "capture(plan=...)", "the captured model", params=True,
                         global_only=True, flag="TP group size")

    def __exit__(self, exc_type, exc, tb) -> bool:
        if not self.active:
            return False
        try:
            return self._exit(exc_type)
        finally:
            self._lock.close()  # DIR is free once the capture is on disk (or given up)

    def _exit(self, exc_type) -> bool:
        self._stack.close()  # probes removed whatever happens
        if exc_type is not None:
            # no gather: a peer may be gone; no manifest: DIR is not a capture. The host records
            # go now (their spill writer thread joined, its files removed): nothing of the
            # capture outlives the block
            from tpdiag.probes.stream import close_stores

            close_stores(self.rec.records)
            return False
        self._finish()
        return False

    # -- what the user records -------------------------------------------------------------
    def batch(self, **tensors: torch.Tensor) -> None:
        """The step's inputs (token ids, labels, masks): recorded as compare records its batch."""
        for name, t in tensors.items():
            if isinstance(t, torch.Tensor) and t.numel() == 0:
                # no tokens: every later record is empty or NaN (a mean over nothing), and two such
                # captures would compare as a non-finite finding or as bitwise about nothing
                raise BadInput(f"cap.batch({name}=...): an empty tensor (shape {list(t.shape)}); a step "
                               "needs at least one token to compare")
            self._add("batch", name, t, "init")

    def logits(self, t: torch.Tensor) -> None:
        """The model's final logits (a vocab-sharded DTensor is gathered like any record)."""
        self._add("logits", "logits", t, "loss")

    def logprobs(self, t: torch.Tensor) -> None:
        """Per-token log-probabilities of the labels (the numbers RL compares across engines)."""
        self._add("logprobs", "logprobs", t, "loss")

    def loss(self, t: torch.Tensor) -> None:
        self._add("loss", "loss", t, "loss")

    def grad_norm(self, t: torch.Tensor) -> None:
        self._add("grad_norm", "total", t, "optimizer")

    def params(self) -> None:
        """Parameters as they are now: call after the optimizer step."""
        if self.active:
            from tpdiag.probes.model_walk import record_params

            phase, self.rec.phase = self.rec.phase, "optimizer"
            record_params(self.rec, self.model, "param", self.plan)
            self.rec.phase = phase

    def next_step(self) -> None:
        """Start the next training step (records are keyed by step)."""
        if self.active:
            self.rec.step += 1
            self.rec.phase = "forward"

    def _add(self, kind: str, name: str, t, phase: str) -> None:
        if not self.active:
            return
        if not isinstance(t, torch.Tensor):
            raise BadInput(f"cap.{kind}(...): expected a tensor, got {type(t).__name__}")
        with torch.no_grad():
            self.rec.add(kind, "model", name, t.detach(), phase=phase)

    # -- on exit -----------------------------------------------------------------------------
    def _finish(self) -> None:
        import torch.distributed as dist

        from tpdiag.probes.piece_merge import last_grads
        from tpdiag.runner.gather import gather_records

        last_grads(self.rec)  # a step accumulating grads over micro-batches: each grad's last record
        apply_layouts(self.rec.records, self.layouts)
        device = collective_device(self.group)
        t1 = time.perf_counter()
        from tpdiag.probes.stream import close_stores

        stored = gather_records(self.rec.records, device, self.group, stream=True,
                                spill_dir=os.path.join(self.out, f".spill-rank{self.group_rank}-out"))
        try:
            if self.group_rank == 0:
                self._write(stored, device, t1)
        finally:
            from tpdiag.probes.host_store import release_pool

            close_stores(self.rec.records, stored or [])
            release_pool()  # pinned host memory goes back to the user's process
        if dist.is_initialized():
            # Nobody leaves before the capture is on disk: a launcher like torchrun tears the
            # whole job down when one rank dies, and must not kill the writer half-way. (The
            # gathers above waited for gloo's worker threads to let go of their tensors -
            # base/gloo_release.py - so none is freed by a worker during interpreter exit,
            # the "terminate called without an active exception" abort of issue 61; a barrier
            # hands gloo no Python tensor.)
            dist.barrier(group=self.group)

    def _write(self, stored, device, t1) -> None:
        import torch.distributed as dist

        from tpdiag.base import files as io
        from tpdiag.records import store

        backend = dist.get_backend(self.group) if dist.is_initialized() else None
        import uuid

        timings = {"capture_s": round(t1 - self.t0, 3), "gather_s": round(time.perf_counter() - t1, 3)}
        # a capture's own name: `tpdiag diff` refuses two sides whose world.json are byte for byte the
        # same (a run and its copy, records/diff_sides.py), and two captures of one deterministic step
        # differed only by their millisecond timings - equal now and then, refused as copies
        store.write(self.out, stored, {
            "degree": self.degree, "label": str(self.degree), "backend": backend,
            "device": str(device), "tool": TOOL, "timings": timings, "n_records": len(stored),
            "config": self._config(), "capture_id": uuid.uuid4().hex, **self._hooks,
            "optimizer_steps": self.optimizer_steps,
        })
        from tpdiag.records.run_files import write_manifest

        write_manifest(self.out, self._manifest(backend, device, timings))

    def _config(self) -> dict:
        return {"seed": self.seed, "backward": self.backward, "params": self.with_params,
                "modules": self.module_globs, "steps": self.rec.step + 1, "oracle": self.oracle_globs,
                "optimizer": self.watch_optimizer}

    def _manifest(self, backend, device, timings) -> dict:
        import torch.distributed as dist

        from tpdiag.records.hashing import HASH_VERSION
        from tpdiag.records.provenance import versions
        from tpdiag.runner.determinism import numerics_env

        dtypes = Counter(p["dtype"] for p in self.fingerprint["params"].values())
        return {
            "schema": SCHEMA, "tool": TOOL, "complete": True, "hash_version": HASH_VERSION,
            "versions": versions("cuda" if device.type == "cuda" else "cpu"),
            "backend": backend, "device": str(device), "degree": self.degree,
            "world_size": dist.get_world_size() if dist.is_initialized() else 1,
            "seed": self.seed, "dtype": dtypes.most_common(1)[0][0] if dtypes else None,
            "config": self._config(), "layouts": self.layouts,
            "plan": {k: plan_label(v) for k, v in self.plan.items()},
            "model": {"class": type(self.model).__name__, "fingerprint": self.fingerprint},
            "env": numerics_env(), "timings": timings, "argv": sys.argv,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }


def _oracle_globs(oracle) -> list[str] | None:
    if oracle is None or oracle is False:
        return None
    if oracle is True:
        return ["*"]
    if isinstance(oracle, str):
        oracle = [oracle]
    if not isinstance(oracle, (list, tuple)) or not all(isinstance(g, str) and g for g in oracle):
        raise BadInput(f"capture(oracle=...): expected True or a list of module-name globs, got {oracle!r}")
    return list(oracle) or None


class _CallableModule(types.ModuleType):
    """`tpdiag.capture(...)` must work although importing this module makes `tpdiag.capture`
    the module itself (the import system sets the package attribute): calling the module
    calls `capture`."""

    def __call__(self, *args, **kwargs):
        return capture(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
