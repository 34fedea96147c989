"""One TP world's work on one rank: build, shard, run forward/logprobs/loss/backward/optimizer."""
from __future__ import annotations

import time
from contextlib import ExitStack, nullcontext

import torch
import torch.nn.functional as F

from tpdiag.config import WorldConfig
from tpdiag.probes.recorder import Recorder

IGNORE = -100


def build_model(cfg: WorldConfig, device: torch.device, world: int):
    from tpdiag.models.spec import load_target, parse_spec

    torch.manual_seed(cfg.seed)
    target = load_target(parse_spec(cfg.model), cfg.variant)
    model = target.model.to(device=device, dtype=getattr(torch, cfg.dtype))
    if world > 1 and target.plan:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import parallelize_module

        _check_plan(model, target.plan)
        mesh = init_device_mesh(device.type, (world,))
        parallelize_module(model, mesh, target.plan)
    return target, model


def _check_plan(model, plan: dict) -> None:
    import fnmatch

    from tpdiag.errors import BadInput

    names = [n for n, _ in model.named_modules()]
    for pattern in plan:
        if not any(fnmatch.fnmatchcase(n, pattern) for n in names):
            raise BadInput(f"plan entry {pattern!r} matches no module of the model")
    for n in names:
        hits = [p for p in plan if fnmatch.fnmatchcase(n, p)]
        if len(hits) > 1:
            raise BadInput(f"plan entries {hits[0]!r} and {hits[1]!r} both match module {n!r}")


def make_batch(cfg: WorldConfig, target, device):
    """The same batch on every rank and degree: drawn from a generator seeded by cfg.seed."""
    g = torch.Generator().manual_seed(cfg.seed + 1)
    if target.inputs is not None:
        batch = target.inputs(g)
    else:
        batch = torch.randint(0, target.vocab_size, (cfg.batch_size, cfg.seq_len), generator=g)
    if isinstance(batch, torch.Tensor):
        batch = {"input_ids": batch}
    batch = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
    labels = batch.pop("labels", None)
    if labels is None:
        ids = batch["input_ids"]
        # Next-token labels; the last position has none and is ignored.
        labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], IGNORE)], dim=1)
    return batch, labels


def logits_of(out):
    if isinstance(out, torch.Tensor):
        return out
    if hasattr(out, "logits"):
        return out.logits
    if isinstance(out, (tuple, list)):
        return out[0]
    raise TypeError(f"cannot find logits in model output of type {type(out).__name__}")


def default_loss(logits, labels):
    return F.cross_entropy(logits.flatten(0, -2), labels.flatten(), ignore_index=IGNORE)


def token_logprobs(logits, labels):
    """log p(label) per token; the vocab-parallel log-softmax runs on sharded logits."""
    lp = -F.cross_entropy(logits.flatten(0, -2), labels.flatten(), ignore_index=IGNORE,
                          reduction="none")
    return lp


def grad_norm_and_clip(params, max_norm: float | None):
    """Global L2 norm of all grads (sharded ones reduced across ranks), clip if asked."""
    from torch.distributed.tensor import DTensor

    norms = []
    for p in params:
        if p.grad is None:
            continue
        n = torch.linalg.vector_norm(p.grad, dtype=torch.float32)
        norms.append(n.full_tensor() if isinstance(n, DTensor) else n)
    total = torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())
    if max_norm is not None and norms:
        coef = float(torch.clamp(max_norm / (total + 1e-6), max=1.0))
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef)
    return total


def _numerics(target):
    """The loss, logprob and grad-norm functions, swapped for invariant ones by their fixes."""
    from tpdiag.fixes import state

    loss_fn, logprob_fn, norm_fn = target.loss or default_loss, token_logprobs, grad_norm_and_clip
    if state.active("invariant-vocab-softmax") and target.loss is None:
        from tpdiag.kernels import tree, vocab_ce

        g, v = tree.n_groups(), target.vocab_size
        loss_fn = lambda lo, lab: vocab_ce.cross_entropy(lo, lab, g, v)  # noqa: E731
        logprob_fn = lambda lo, lab: vocab_ce.token_logprobs(lo, lab, g, v)  # noqa: E731
    if state.active("invariant-grad-norm"):
        from tpdiag.kernels.grad_norm import grad_norm_and_clip as norm_fn
    return loss_fn, logprob_fn, norm_fn


def capture_mode(capture: str, model) -> str:
    """'full' or 'hash'; 'auto' hashes models above AUTO_HASH_PARAMS (counted whole: a
    DTensor parameter's numel is its global size, so every degree decides the same)."""
    if capture != "auto":
        return capture
    from tpdiag.config import AUTO_HASH_PARAMS

    n = sum(p.numel() for p in model.parameters())
    return "hash" if n > AUTO_HASH_PARAMS else "full"


def loss_context(world: int):
    if world > 1:
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()
    return nullcontext()


def run(cfg: WorldConfig, device: torch.device, world: int, rec: Recorder) -> dict:
    from tpdiag.probes.module_probe import module_probes, record_params

    timings = {}
    t0 = time.perf_counter()
    target, model = build_model(cfg, device, world)
    rec.mode = capture_mode(cfg.capture, model)
    rec.world = world
    rec.rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    include = set(cfg.module_include) or None
    batch, labels = make_batch(cfg, target, device)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, foreach=False) if cfg.backward else None
    timings["build_s"] = time.perf_counter() - t0

    with ExitStack() as stack:
        from tpdiag.fixes.registry import apply_fixes

        stack.enter_context(apply_fixes(cfg.fixes, model=model, plan=target.plan, world=world))
        loss_fn, logprob_fn, norm_fn = _numerics(target)
        if cfg.probes:
            stack.enter_context(module_probes(model, rec, plan=target.plan, backward=cfg.backward,
                                              include=include))
            if cfg.granularity == "op":
                from tpdiag.probes.op_probe import OpProbe

                stack.enter_context(OpProbe(rec, include=set(cfg.op_include) or None))
        rec.phase = "init"
        for k, v in batch.items():
            rec.add("batch", "model", k, v)
        rec.add("batch", "model", "labels", labels)
        record_params(rec, model, "param_init", target.plan, include)
        t1 = time.perf_counter()
        for step in range(cfg.steps):
            rec.step = step
            rec.phase = "forward"
            out = model(**batch)
            logits = logits_of(out)
            rec.phase = "loss"
            rec.add("logits", "model", "logits", logits)
            with loss_context(world):
                with torch.no_grad():
                    lp = logprob_fn(logits.detach(), labels)
                rec.add("logprobs", "model", "logprobs", lp)
                loss = loss_fn(logits, labels)
                rec.add("loss", "model", "loss", loss)
                if cfg.backward:
                    rec.phase = "backward"
                    loss.backward()
            if cfg.backward:
                rec.phase = "optimizer"
                params = list(model.parameters())
                total = norm_fn(params, cfg.clip_norm)
                rec.add("grad_norm", "model", "total", total)
                opt.step()
                opt.zero_grad(set_to_none=True)
                record_params(rec, model, "param", target.plan, include)
            del out, logits, loss
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        timings["steps_s"] = time.perf_counter() - t1
    return timings
