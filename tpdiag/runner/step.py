"""One TP world's work on one rank: build, shard, run forward/logprobs/loss/backward/optimizer."""
from __future__ import annotations

import time
from contextlib import ExitStack, nullcontext

import torch
import torch.nn.functional as F

from tpdiag.config import WorldConfig
from tpdiag.probes.recorder import Recorder
from tpdiag.runner.logits import logits_of, whole_vocab  # noqa: F401 (logits_of: re-exported)

IGNORE = -100


def build_model(cfg: WorldConfig, device: torch.device, world: int):
    """(target, model) on this rank, sharded when world > 1. Built-in presets and hf: models are
    sharded on the meta device and materialised module by module (no rank holds the whole
    model: tpdiag.models.shard_init); py: targets, and a model that cannot take that route
    (the reason in target.build), are built whole, cast, then sharded."""
    from tpdiag.models.build import build_sharded, build_target
    from tpdiag.models.spec import parse_spec

    torch.manual_seed(cfg.seed)  # py: targets built on the CPU draw from the global RNG
    spec, dtype, mesh, reason = parse_spec(cfg.model, cfg.layers), getattr(torch, cfg.dtype), None, None
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh

        from tpdiag.models.shard_init import ShardedInitUnsupported

        mesh = init_device_mesh(device.type, (world,))
        try:
            built = build_sharded(spec, cfg.variant, device, cfg.seed, dtype, mesh, _check_plan)
        except ShardedInitUnsupported as e:
            built, reason = None, str(e)
        if built is not None:
            return built
        torch.manual_seed(cfg.seed)
    target = build_target(spec, cfg.variant, device, cfg.seed)
    live = {id(t): t for t in list(target.model.parameters()) + list(target.model.buffers())}
    whole = sum(t.numel() * t.element_size() for t in live.values())
    from tpdiag.models.dtypes import to_run_dtype

    # the user's model as the user loads it: not nn.Module.to(dtype) (tpdiag.models.dtypes)
    model = to_run_dtype(spec.kind, target.model.to(device=device), dtype)
    if world > 1 and target.plan:
        from torch.distributed.tensor.parallel import parallelize_module

        from tpdiag.models.ties import broken_ties, tie_groups

        _check_plan(model, target.plan)
        ties = tie_groups(model)
        parallelize_module(model, mesh, target.plan)
        broken = broken_ties(model, ties)
    else:
        broken = []
    target.build = {"init": "whole", "init_full_peak_bytes": whole, "init_whole_bytes": whole,
                    "init_reason": reason or ("TP=1" if world == 1 else
                                              f"{spec.kind}: the whole model is built, then sharded")}
    if broken:
        target.build["ties_broken"] = broken
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
    """The same batch on every rank and degree: drawn from a generator seeded by cfg.seed.

    Returns (batch, labels); batch is a Tensor, a tuple (positional args) or a dict (keywords),
    as `Target.inputs` gave it (tokens only: a Tensor). `forward_call` binds it to the model."""
    g = torch.Generator().manual_seed(cfg.seed + 1)
    if target.inputs is not None:
        batch = target.inputs(g)
    else:
        batch = torch.randint(0, target.vocab_size, (cfg.batch_size, cfg.seq_len), generator=g)

    def move(v):
        return v.to(device) if isinstance(v, torch.Tensor) else v

    labels = None
    if isinstance(batch, dict):
        batch = {k: move(v) for k, v in batch.items()}
        labels = batch.pop("labels", None)
    elif isinstance(batch, (tuple, list)):
        batch = tuple(move(v) for v in batch)
    elif isinstance(batch, torch.Tensor):
        batch = move(batch)
    else:
        from tpdiag.errors import BadInput

        raise BadInput(f"Target.inputs returned {type(batch).__name__}; expected a Tensor (the "
                       "tokens), a tuple (positional args) or a dict (keywords, 'labels' optional)")
    if labels is None:
        ids = tokens_of(batch)
        # Next-token labels; the last position has none and is ignored.
        labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], IGNORE)], dim=1)
    return batch, labels


def tokens_of(batch) -> torch.Tensor:
    """The token ids in a batch: the Tensor itself, a dict's 'input_ids' (else its first
    tensor), a tuple's first tensor."""
    from tpdiag.errors import BadInput

    if isinstance(batch, torch.Tensor):
        cands = [batch]
    elif isinstance(batch, dict):
        cands = [batch["input_ids"]] if "input_ids" in batch else list(batch.values())
    else:
        cands = list(batch)
    ids = next((t for t in cands if isinstance(t, torch.Tensor)), None)
    if ids is None or ids.ndim < 2 or ids.is_floating_point():
        raise BadInput("Target.inputs gave no 'labels' and no [batch, seq] token tensor to derive "
                       "next-token labels from; return {'...': tokens, 'labels': labels}")
    return ids


def batch_items(batch) -> list[tuple[str, object]]:
    """(record name, value) per batch entry: a Tensor is 'input_ids', tuple items 'argI'."""
    if isinstance(batch, torch.Tensor):
        return [("input_ids", batch)]
    if isinstance(batch, dict):
        return list(batch.items())
    return [(f"arg{i}", v) for i, v in enumerate(batch)]


def forward_call(model, batch) -> tuple[tuple, dict]:
    """(args, kwargs) for model(...): a dict as keywords, a tuple as positional args, a Tensor
    bound to forward's first parameter whatever its name (`forward(self, tokens)`,
    `forward(self, input_ids)`) - by keyword only where that parameter is keyword-only."""
    import inspect

    from tpdiag.errors import BadInput

    if isinstance(batch, dict):
        return (), batch
    if isinstance(batch, tuple):
        return batch, {}
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):  # no signature to read (a C extension): positional
        return (batch,), {}
    if not params:
        raise BadInput(f"{type(model).__name__}.forward takes no argument: tpdiag has tokens "
                       "to feed it (give Target.inputs to say how)")
    first = params[0]
    if first.kind is inspect.Parameter.KEYWORD_ONLY:
        return (), {first.name: batch}
    if first.kind is inspect.Parameter.VAR_KEYWORD:
        return (), {"input_ids": batch}
    return (batch,), {}


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
        # as torch's clip_grad_norm_: the coefficient stays on the device (no host sync)
        from tpdiag.kernels.grad_norm import scale_grads

        scale_grads([p.grad for p in params if p.grad is not None],
                    torch.clamp(max_norm / (total + 1e-6), max=1.0))
    return total


def _numerics(target):
    """The loss, logprob and grad-norm functions, swapped for invariant ones by their fixes."""
    from tpdiag.fixes import registry

    loss_fn, logprob_fn, norm_fn = target.loss or default_loss, token_logprobs, grad_norm_and_clip
    if registry.takes_over("loss") and target.loss is None:
        from tpdiag.kernels import tree, vocab_ce

        g, v = tree.n_groups(), target.vocab_size
        loss_fn = lambda lo, lab: vocab_ce.cross_entropy(lo, lab, g, v)  # noqa: E731
        logprob_fn = lambda lo, lab: vocab_ce.token_logprobs(lo, lab, g, v)  # noqa: E731
    if registry.takes_over("grad-norm"):
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


def _mark(marks: dict, phase: str, since: float) -> float:
    now = time.perf_counter()
    marks[phase] = marks.get(phase, 0.0) + now - since
    return now


def decode_prefix(seq_len: int, calls: int) -> tuple[int, int]:
    """(prompt length, positions): a decode world's prompt call and its first `calls` one-token
    calls cover positions [0, positions) - the unprobed self-check's run (runner/worker.py)."""
    from tpdiag.runner import decode as dec

    P = dec.default_prompt_len(seq_len)
    return P, min(seq_len, P + calls)


def _decode(model, batch, rec: Recorder, prompt_len: int | None = None, report=None):
    """The logits of a decode world: the batch's tokens as a rollout engine runs them - the
    prompt (half the sequence) in one call, then one token per call through the model's KV cache
    (runner/decode.py); each call's records are positions [start, stop) of the reference's.
    prompt_len: the whole sequence's, when batch is a prefix of it (the self-check's run)."""
    from tpdiag.errors import BadInput
    from tpdiag.runner import decode as dec

    if not isinstance(batch, torch.Tensor):
        raise BadInput(f"--mode decode: the batch must be token ids alone; this model's Target.inputs "
                       f"gives a {type(batch).__name__}")
    if not dec.supports(model):
        raise BadInput(f"--mode decode: {dec.why_not(model)}")
    L = batch.shape[1]
    P = dec.default_prompt_len(L) if prompt_len is None else prompt_len
    n = 1 + L - P
    calls = iter(range(n))

    def on_call(a, b):
        k = next(calls)
        rec.begin_piece(k, n, (a, b, L))
        if report is not None:
            report(f"decode call {k + 1} of {n}")

    try:
        pieces = dec.decode(model, batch, P, on_call=on_call, generate_args=False)
    except dec.Unsupported as e:
        raise BadInput(f"--mode decode: {e}") from None
    finally:
        rec.end_pieces()
    return dec.assemble(pieces)


def run(cfg: WorldConfig, device: torch.device, world: int, rec: Recorder, *,
        fingerprint: bool = False, decode_check: int = 0, decode_only_check: bool = False) -> dict:
    """One world's steps; fingerprint=True: rec.fingerprint = the last step's final values'
    hashes (runner/fingerprint.py), taken after the step's timing. A decode world with
    decode_check=K: rec.decode_check = (positions, hash of the logits of the prompt call and
    the first K one-token calls); decode_only_check: run only those calls (the self-check)."""
    from tpdiag.probes.module_probe import module_probes, record_params

    timings = {}
    t0 = time.perf_counter()
    target, model = build_model(cfg, device, world)
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # the init kernels are asynchronous
    timings["model_s"] = time.perf_counter() - t0  # built, initialised and sharded
    timings.update(getattr(target, "build", None) or {})  # which init path, its peak bytes
    # what this world computed under: its backend flags and each tensor's dtype (the manifest)
    from tpdiag.models.dtypes import buffer_dtypes, param_dtypes
    from tpdiag.runner.flags import snapshot

    timings["numerics"] = {"flags": cfg.flags, "flag_values": snapshot(),
                           "buffer_dtypes": buffer_dtypes(model), "param_dtypes": param_dtypes(model)}
    rec.mode = capture_mode(cfg.capture, model)
    rec.world = world
    rec.rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    report = None
    if cfg.mode == "decode":
        from tpdiag.runner.progress import Reporter

        report = Reporter(cfg.out_dir, rec.rank)
    include = set(cfg.module_include) or None
    batch, labels = make_batch(cfg, target, device)
    prompt_len = checked = None
    seq = batch.shape[1] if isinstance(batch, torch.Tensor) and batch.dim() > 1 else 0
    if cfg.mode == "decode" and decode_check and isinstance(batch, torch.Tensor):
        prompt_len, checked = decode_prefix(batch.shape[1], decode_check)
        if cfg.positions:
            checked = min(checked, cfg.positions)
        if decode_only_check:
            batch, labels = batch[:, :checked], labels[:, :checked]
    from tpdiag.runner import prefix

    batch, labels, prompt_len = prefix.setup(cfg, rec, batch, labels, prompt_len, seq)
    args, kwargs = forward_call(model, batch)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, foreach=False) if cfg.backward else None
    timings["build_s"] = time.perf_counter() - t0

    with ExitStack() as stack:
        from tpdiag.fixes.groups import PER_GROUP
        from tpdiag.fixes.registry import apply_fixes
        from tpdiag.kernels.tree import run_groups

        # the run's G, the same in every rank of every world (before the fixes read it)
        stack.enter_context(run_groups(cfg.tree_groups, cfg.group_gemm == PER_GROUP))
        from tpdiag.errors import BadInput
        from tpdiag.runner.attention import attention
        from tpdiag.runner.decode import is_hf
        from tpdiag.runner.sdpa_ran import SdpaRan

        # the configuration's attention implementation (the --attention axis; 'auto': the model's own):
        # an SDPA backend within SDPA; never a switch of an hf: model's implementation, which would
        # build its layers other inputs (another mask) than the reference's (runner/compare.py)
        if cfg.attention != "auto" and is_hf(model) and model.config._attn_implementation != "sdpa":
            raise BadInput(f"--attention {cfg.attention}: {type(model).__name__} runs "
                           f"{model.config._attn_implementation!r} attention, not SDPA: switching it builds "
                           "its layers another attention mask than the reference's (other records); compare "
                           "it with tpdiag rollout --attention instead")
        stack.enter_context(attention(model, cfg.attention, BadInput))

        # which SDPA backend the step's attention ran (the manifest's flags line says it), asked
        # outside the records; outside the fixes, as rollout's (the invariant attention's calls)
        ran = stack.enter_context(SdpaRan(pause=rec._paused))
        stack.enter_context(apply_fixes(cfg.fixes, model=model, plan=target.plan, world=world))
        loss_fn, logprob_fn, norm_fn = _numerics(target)
        if cfg.probes:
            stack.enter_context(module_probes(model, rec, plan=target.plan, backward=cfg.backward,
                                              include=include, oracle=set(cfg.oracle) or None,
                                              own=dict(cfg.oracle_own) or None))
            if cfg.granularity == "op":
                from tpdiag.probes.op_probe import OpProbe

                stack.enter_context(OpProbe(rec, include=set(cfg.op_include) or None,
                                            oracle=cfg.oracle_ops, model=model))
        rec.phase = "init"
        for k, v in batch_items(batch):
            rec.add("batch", "model", k, v)
        rec.add("batch", "model", "labels", labels)
        record_params(rec, model, "param_init", target.plan, include)
        t1 = time.perf_counter()
        # host time by phase (the host's view: a phase that waits on the GPU includes the wait)
        marks = timings["phases_s"] = {}
        from tpdiag.runner import micro

        parts = micro.split(batch, labels, cfg.micro_batch)
        n_total = micro.n_tokens(labels)
        invariant_ce = loss_fn is not (target.loss or default_loss)
        carry = micro.carry_window(cfg, parts, device)
        for step in range(cfg.steps):
            rec.step = step
            loss_sum, lps = None, []
            # the pieces' weight grads: fp32 carries, rounded once as the window closes (runner/micro.py)
            with carry(model):
                for k, (piece, piece_labels) in enumerate(parts):
                    if len(parts) > 1:
                        rec.begin_piece(k, len(parts))
                        args, kwargs = forward_call(model, piece)
                    rec.phase = "forward"
                    tp = time.perf_counter()
                    # forward only: no autograd graph, as an engine or a logprob pass runs (a decode
                    # world's graph would chain every call through the growing KV cache: quadratic memory)
                    with torch.set_grad_enabled(bool(cfg.backward)):
                        out = _decode(model, batch, rec, prompt_len, report) if cfg.mode == "decode" \
                            else model(*args, **kwargs)
                    tp = _mark(marks, "forward", tp)
                    local_logits = logits_of(out)
                    if checked is not None:
                        from tpdiag.base.dtensors import local_of
                        from tpdiag.records.hashing import tensor_hash

                        with rec._paused():  # not a record of the step (op probe)
                            rec.decode_check = (checked, tensor_hash(local_of(local_logits)[:, :checked].detach()))
                    # an unmarked local vocab shard (ColwiseParallel's default use_local_output=True)
                    # is re-marked whole for tpdiag; a user loss still gets what the model returned
                    logits, _ = whole_vocab(local_logits, model, target.plan, target.vocab_size, world)
                    whole_logits = logits  # the fingerprint's: the step pass 1 computed (runner/drill.py)
                    logits, local_logits, piece_labels = prefix.cut_loss_inputs(cfg, logits, local_logits, piece_labels)
                    labels = piece_labels if len(parts) == 1 else labels
                    rec.phase = "loss"
                    rec.add("logits", "model", "logits", logits)
                    with loss_context(world):
                        with torch.no_grad():
                            lp = logprob_fn(logits.detach(), piece_labels)
                        rec.add("logprobs", "model", "logprobs", lp)
                        if len(parts) == 1:
                            loss = loss_fn(local_logits if target.loss is not None else logits, labels)
                            rec.add("loss", "model", "loss", loss)
                        else:
                            loss = micro.piece_loss(target, loss_fn, logits, local_logits, piece_labels,
                                                    n_total, invariant_ce)
                            loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
                            lps.append(lp)
                        tp = _mark(marks, "loss", tp)
                        if cfg.backward:
                            rec.phase = "backward"
                            loss.backward()
                            tp = _mark(marks, "backward", tp)
            if cfg.backward:  # the window's close: the grads into .grad (their probes record them)
                tp = _mark(marks, "backward", tp)
            if len(parts) > 1:
                # the step's loss, per step, not per piece: the pieces' shares summed, as a trainer
                # logs it; under the invariant cross-entropy the tokens' logprobs reduced once, in
                # the reference's order (per token, the logprobs compare across micro-batch sizes)
                rec.end_pieces()
                rec.phase = "loss"
                loss = micro.step_loss(lps, n_total, logits.dtype) if invariant_ce else loss_sum
                with loss_context(world):
                    rec.add("loss", "model", "loss", loss)
            if cfg.backward:
                rec.phase = "optimizer"
                params = list(model.parameters())
                total = norm_fn(params, cfg.clip_norm)
                rec.add("grad_norm", "model", "total", total)
                tp = _mark(marks, "clip", tp)
                opt.step()
                opt.zero_grad(set_to_none=True)
                tp = _mark(marks, "optimizer", tp)
                record_params(rec, model, "param", target.plan, include)
                tp = _mark(marks, "params", tp)
            if fingerprint and step == cfg.steps - 1:  # detached: no graph, nothing else kept
                last = {"logits": whole_logits.detach(), "logprobs": lp.detach(), "loss": loss.detach(),
                        "grad_norm": total.detach() if cfg.backward else None}
            del out, logits, whole_logits, local_logits, loss
        if len(parts) > 1 or cfg.mode == "decode":
            from tpdiag.probes.pieces import merge

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
