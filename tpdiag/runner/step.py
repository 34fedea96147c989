"""One TP world's work on one rank: build, shard, then every step's pieces (runner/piece.py: forward
and loss) and its backward and optimizer step (runner/update.py), each in its recorder phase."""
from __future__ import annotations

import time
from contextlib import ExitStack

import torch

from tpdiag.config import WorldConfig
from tpdiag.probes.recorder import Recorder
from tpdiag.runner import piece as pieces
from tpdiag.runner import update
from tpdiag.runner.batch import batch_items, make_batch
from tpdiag.runner.build import build_model, capture_mode
from tpdiag.runner.phases import Phases


def decode_prefix(seq_len: int, calls: int) -> tuple[int, int]:
    """(prompt length, positions): a decode world's prompt call and its first `calls` one-token
    calls cover positions [0, positions) - the unprobed self-check's run (runner/worker.py)."""
    from tpdiag.runner import decode as dec

    P = dec.default_prompt_len(seq_len)
    return P, min(seq_len, P + calls)


def build(cfg: WorldConfig, device: torch.device, world: int) -> tuple:
    """(target, model, seconds): the world's model built, initialised and sharded."""
    t0 = time.perf_counter()
    target, model = build_model(cfg, device, world)
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the init kernels are asynchronous
    return target, model, time.perf_counter() - t0


def run(cfg: WorldConfig, device: torch.device, world: int, rec: Recorder, *,
        fingerprint: bool = False, decode_check: int = 0, decode_only_check: bool = False,
        built: tuple | None = None) -> dict:
    """One world's steps; fingerprint=True: rec.fingerprint = the last step's final values'
    hashes (runner/fingerprint.py), taken after the step's timing. A decode world with
    decode_check=K: rec.decode_check = (positions, hash of the logits of the prompt call and
    the first K one-token calls); decode_only_check: run only those calls (the self-check).
    built: build()'s (target, model, seconds) to run on - model_s is then its seconds - instead
    of building one."""
    timings = {}
    target, model, timings["model_s"] = built or build(cfg, device, world)
    t0 = time.perf_counter() - timings["model_s"]  # build_s counts the build wherever it ran
    built_how = dict(getattr(target, "build", None) or {})
    # a fact of the model as sharded, not a timing: world.json's own field (runner/worker.py)
    rec.ties_broken = built_how.pop("ties_broken", None) or []
    rec.hooks_dropped = built_how.pop("hooks_dropped", None) or {}
    if world == 1:  # the user's grad hooks run here: whether they change the grad (models/grad_hooks.py)
        from tpdiag.models.grad_hooks import watch

        watch(model, rec.hook_effect)
    else:  # ... and here the hooks the plan kept: with hooks_dropped, every hooked parameter the reference's
        # hook_effect names (diff/dropped_hooks.census: hooks_dropped cut from world.json is seen)
        from tpdiag.models.grad_hooks import grad_hooks

        rec.hooks_kept = sorted(grad_hooks(model))
    rec.per_rank_params = built_how.pop("per_rank_params", 0)
    timings.update(built_how)  # which init path, its peak bytes
    timings["numerics"] = _numerics(cfg, model)
    rec.mode = capture_mode(cfg.capture, model)
    rec.world = world
    rec.rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    batch, labels, forward = _inputs(cfg, target, model, device, rec, decode_check, decode_only_check)
    opt = update.optimizer(model, cfg.lr) if cfg.backward else None
    timings["build_s"] = time.perf_counter() - t0

    with ExitStack() as stack:
        ran, fns = _contexts(stack, cfg, model, target, world, rec)
        phases = Phases(rec)
        from tpdiag.probes.model_walk import record_params

        include = set(cfg.rerun.module_include) or None
        with phases("init", timed=False):
            for k, v in batch_items(batch):
                rec.add("batch", "model", k, v)
            rec.add("batch", "model", "labels", labels)
            record_params(rec, model, "param_init", target.plan, include)
            from tpdiag.probes.own_params import mark_recorded

            mark_recorded(model)
        t1 = time.perf_counter()
        timings["phases_s"] = phases.marks
        from tpdiag.runner import micro

        parts = micro.split(batch, labels, cfg.micro_batch)
        # once, before the steps: its torch ops are the op probe's records of step 0's init phase
        n_total = micro.n_tokens(labels)
        carry = micro.carry_window(cfg, parts, device)
        from tpdiag.runner import anchor

        saving = anchor.saves(cfg)
        if saving:
            too_big = anchor.over_budget(cfg, model)
            if rec.rank == 0:
                anchor.clear(cfg.out_dir)  # an earlier run's states in this folder are not this run's
                if too_big:
                    anchor.refuse(cfg.out_dir, too_big)  # each TP > 1 world says why it loaded none
            saving = not too_big
        for step in range(cfg.steps):
            rec.step = step
            if step and saving:
                with rec._paused():  # a TP > 1 reference's gathers (collectives) are no records
                    anchor.save(anchor.state_file(cfg.out_dir, step), model, opt, write=rec.rank == 0)
            elif step and anchor.loads(cfg) and not (rec.anchor or {}).get("refused"):
                with rec._paused():  # the ranks' agreement (a collective) is no record
                    why = anchor.load(anchor.state_file(cfg.ref_dir, step), model, opt)
                done = [*(rec.anchor or {}).get("steps", ())]
                rec.anchor = {"steps": done, "refused": why, "refused_at": step} if why else {"steps": [*done, step]}
            keep = fingerprint and step == cfg.steps - 1
            last = _step(cfg, phases, forward, model, target, world, opt, fns, parts, n_total, carry, include, keep)
        if len(parts) > 1 or forward.pieced:
            from tpdiag.probes.piece_merge import merge

            with rec._paused():  # the merge's own torch ops are not records (op probe)
                merge(rec)  # the pieces' records made the whole step's, in the reference's order
        # until the host issued the step's last work, waits on the GPU inside included (grad
        # clipping reads the norm back): close to steps_s = no GPU backlog at the end, which alone
        # does not say the host paces the step (`probes profile --kineto` shows the GPU's busy time)
        timings["issue_s"] = time.perf_counter() - t1
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        timings["steps_s"] = time.perf_counter() - t1
    timings["numerics"]["sdpa_ran"] = dict(ran.counts)
    if fingerprint:
        from tpdiag.runner.fingerprint import step_fingerprint

        # probes and fixes are off again: hashing here records nothing
        rec.fingerprint = step_fingerprint(last, model)
    return timings


def _step(cfg, phases, forward, model, target, world, opt, fns, parts, n_total, carry, include,
          keep: bool) -> dict | None:
    """One step: every piece's forward, loss and backward inside grad accumulation's window,
    then the optimizer. keep: return the step's final values (detached: the fingerprint's)."""
    rec, several = phases.rec, len(parts) > 1
    from tpdiag.probes.model_walk import buffer_state, written_since

    # the buffers as the step found them: those it wrote are recorded after it, and a micro-batch
    # that reads one an earlier micro-batch wrote is named (diff/engine.py, piece_state)
    buffers = buffer_state(model) if rec.enabled and (cfg.backward or several) else None
    from tpdiag.runner.recipe import Recipe

    losses = pieces.Losses(target, fns, n_total, len(parts), world, sum(lab.shape[0] for _, lab in parts),
                           Recipe.of(cfg))
    with ExitStack() as window:
        # the pieces' weight grads: fp32 carries, rounded once as the window closes (runner/micro.py)
        w = window.enter_context(carry(model))
        skipped = getattr(w, "skipped", None)  # the window (kernels/grad_carry.Window), or None
        for k, (piece, piece_labels) in enumerate(parts):
            if several:
                if k and buffers is not None:
                    wrote = written_since(model, buffers)
                    if wrote:
                        had = rec.piece_state.get(str(rec.step), [])
                        rec.piece_state[str(rec.step)] = sorted(set(had) | wrote)
                rec.begin_piece(k, len(parts))
            lo = pieces.forward(cfg, phases, forward, model, target.plan, target.vocab_size, world,
                                piece, piece_labels, several)
            with phases("loss"), losses.piece(rec, lo) as loss:
                if cfg.backward:
                    update.backward(phases, loss)
        if cfg.backward:
            with phases("backward"):  # the window's close: the grads into .grad (their probes record them)
                window.close()
        if skipped:
            rec.not_carried.update(skipped)
    if several:
        rec.end_pieces()
        with phases("loss"):
            loss = losses.step(rec)
    total = None
    if cfg.backward:
        total = update.optimizer_step(phases, rec, model, opt, fns[2], cfg.clip_norm, target.plan, include, buffers)
    if not keep:
        return None
    return {"logits": lo.whole.detach(), "logprobs": losses.lp.detach(), "loss": loss.detach(),
            "grad_norm": total.detach() if total is not None else None}


def _numerics(cfg: WorldConfig, model) -> dict:
    """What this world computed under: its backend flags and each tensor's dtype (the manifest)."""
    from tpdiag.models.dtypes import RECAST, buffer_dtypes, param_dtypes
    from tpdiag.runner.flags import snapshot

    # the ranks' intra-op threads (runner/determinism.py: one in every world): a CPU reduction's
    # bits follow the count
    return {"flags": cfg.flags, "flag_values": snapshot(), "threads": torch.get_num_threads(),
            "buffer_dtypes": buffer_dtypes(model), "param_dtypes": param_dtypes(model),
            **({"recast": model.__dict__[RECAST]} if RECAST in model.__dict__ else {})}


def _inputs(cfg: WorldConfig, target, model, device, rec: Recorder, decode_check: int, decode_only_check: bool):
    """(batch, labels, forward): the step's batch (a decode rerun's or self-check's first positions
    only) and how its forward runs (runner/piece.py)."""
    from tpdiag.runner import prefix

    batch, labels = make_batch(cfg, target, device)
    prompt_len = checked = None
    seq = batch.shape[1] if isinstance(batch, torch.Tensor) and batch.dim() > 1 else 0
    if cfg.mode == "decode" and decode_check and isinstance(batch, torch.Tensor):
        prompt_len, checked = decode_prefix(batch.shape[1], decode_check)
        if cfg.rerun.positions:
            checked = min(checked, cfg.rerun.positions)
        if decode_only_check:
            batch, labels = batch[:, :checked], labels[:, :checked]
    batch, labels, prompt_len = prefix.setup(cfg, rec, batch, labels, prompt_len, seq)
    return batch, labels, pieces.forward_of(cfg, model, batch, rec, prompt_len, checked)


def _contexts(stack: ExitStack, cfg: WorldConfig, model, target, world: int, rec: Recorder):
    """The step's contexts, in order: the run's G, the attention implementation, the SDPA
    backend watch, the fixes, the probes. Returns (the SDPA watch, the step's loss, logprob
    and grad-norm functions)."""
    from tpdiag.errors import BadInput
    from tpdiag.fixes.groups import PER_GROUP
    from tpdiag.fixes.registry import apply_fixes
    from tpdiag.kernels.tree import install_tree_groups
    from tpdiag.runner.attention import attention
    from tpdiag.runner.decode import is_hf
    from tpdiag.runner.losses import step_functions
    from tpdiag.runner.sdpa_ran import SdpaRan

    # the run's G, the same in every rank of every world (before the fixes read it)
    stack.enter_context(install_tree_groups(cfg.tree_groups, cfg.group_gemm == PER_GROUP))
    # the configuration's attention implementation (the --attention axis; 'auto': the model's own):
    # an SDPA backend within SDPA, or eager in every configuration (compare refuses eager beside
    # another value); never a switch from SDPA to another in one configuration only, which would
    # build its layers other inputs (another mask) than the reference's (runner/compare.py)
    if cfg.attention not in ("auto", "eager") and is_hf(model) and model.config._attn_implementation != "sdpa":
        from tpdiag.runner.attention import not_sdpa

        raise BadInput(not_sdpa(cfg.attention, type(model).__name__, model.config._attn_implementation))
    stack.enter_context(attention(model, cfg.attention, BadInput))
    # which SDPA backend the step's attention ran (the manifest's flags line says it), asked
    # outside the records; outside the fixes, as rollout's (the invariant attention's calls)
    ran = stack.enter_context(SdpaRan(pause=rec._paused))
    stack.enter_context(apply_fixes(cfg.fixes, model=model, plan=target.plan, world=world))
    fns = step_functions(target)
    if cfg.probes:
        from tpdiag.probes.module_probe import module_probes

        stack.enter_context(module_probes(model, rec, plan=target.plan, backward=cfg.backward,
                                          include=set(cfg.rerun.module_include) or None,
                                          oracle=set(cfg.rerun.oracle) or None, own=dict(cfg.rerun.oracle_own) or None))
        if cfg.granularity == "op":
            from tpdiag.probes.op_probe import OpProbe

            stack.enter_context(OpProbe(rec, include=set(cfg.rerun.op_include) or None,
                                        oracle=cfg.rerun.oracle_ops, model=model))
    return ran, fns
