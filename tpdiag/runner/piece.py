"""One piece of a step (the whole batch, a micro-batch): its forward and its loss.

How the forward runs is the one thing a world's mode changes: `forward_of` picks it once, so
the step does not ask the mode again - a model call (prefill), or the prompt call and then one
token per call through the KV cache (decode), which also makes pieces of the step's records."""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from tpdiag.probes.recorder import Recorder
from tpdiag.runner import micro, prefix
from tpdiag.runner.batch import forward_call
from tpdiag.runner.logits import check_positions, logits_of, whole_vocab


class _Call:
    """A prefill world's forward: one model call on the piece."""
    pieced = False  # its calls make no pieces of the step's records

    def __init__(self, model, batch):
        self.model, self.bound = model, forward_call(model, batch)

    def __call__(self, piece, several: bool):
        args, kwargs = forward_call(self.model, piece) if several else self.bound
        return self.model(*args, **kwargs)

    def check(self, rec: Recorder, local_logits) -> None:
        pass


class _Decode:
    """A decode world's forward (runner/decode.py); checked: the self-check's positions, whose
    logits' hash it leaves in rec.decode_check."""
    pieced = True

    def __init__(self, model, batch, rec: Recorder, prompt_len, checked, report):
        self.model, self.batch, self.rec = model, batch, rec
        self.prompt_len, self.checked, self.report = prompt_len, checked, report

    def __call__(self, piece, several: bool):
        return _decode(self.model, self.batch, self.rec, self.prompt_len, self.report)

    def check(self, rec: Recorder, local_logits) -> None:
        if self.checked is None:
            return
        from tpdiag.base.dtensors import local_of
        from tpdiag.records.hashing import tensor_hash

        with rec._paused():  # not a record of the step (op probe)
            rec.decode_check = (self.checked, tensor_hash(local_of(local_logits)[:, :self.checked].detach()))


def forward_of(cfg, model, batch, rec: Recorder, prompt_len, checked):
    if cfg.mode != "decode":
        return _Call(model, batch)
    from tpdiag.runner.progress import Reporter

    return _Decode(model, batch, rec, prompt_len, checked, Reporter(cfg.out_dir, rec.rank))


@dataclass
class Logits:
    """A piece's forward: the logits its loss reads and what the fingerprint keeps."""
    out: object
    logits: object  # whole-vocab (a DTensor at TP > 1)
    local: object  # as the model returned them: what a user loss gets
    whole: object  # before a run of the first positions cut them: the fingerprint's
    labels: torch.Tensor


def forward(cfg, phases, fwd, model, plan, vocab_size: int, world: int, piece, labels, several: bool) -> Logits:
    """The forward phase: the model's call and the logits taken from its output (their torch ops
    are the phase's records too)."""
    with phases("forward", last="loss"):
        # forward only: no autograd graph, as an engine or a logprob pass runs (a decode world's
        # graph would chain every call through the growing KV cache: quadratic memory)
        with torch.set_grad_enabled(bool(cfg.backward)):
            out = fwd(piece, several)
        phases.lap("forward")
        local = logits_of(out)
        fwd.check(phases.rec, local)
        # an unmarked local vocab shard (ColwiseParallel's default use_local_output=True) is
        # re-marked whole for tpdiag; a user loss still gets what the model returned
        logits, rule = whole_vocab(local, model, plan, vocab_size, world)
        if rule and rule.startswith("padded"):
            # the diff gathers and cuts the model's padded records by it (records/layout.py)
            rec = phases.rec
            rec.vocab_padding = {"vocab": int(vocab_size), "local": int(local.shape[-1])}
            if rec.producers is not None:
                # the modules whose output the padded logits are: where a rank's shard has the
                # reference's whole shape (every real id on rank 0), the shape cannot tell their
                # records from a hidden state of the padded width (records/layout.py)
                mods = sorted(set(rec.producers(local)))
                if mods:  # none found: no field, the shape rule (records/layout.py)
                    rec.vocab_padding["modules"] = mods
        whole = logits  # the fingerprint's: the step pass 1 computed (runner/drill.py)
        logits, local, labels = prefix.cut_loss_inputs(cfg, logits, local, labels)
        check_positions(logits, labels, world)
    return Logits(out, logits, local, whole, labels)


class Losses:
    """A step's loss over its pieces: one piece's is the step's; several pieces' shares are
    summed, or under the invariant cross-entropy their tokens' logprobs reduced once."""

    def __init__(self, target, fns, n_total, n_pieces: int, world: int, rows_total: int | None = None,
                 recipe=None):
        """n_total: the step's token count (micro.n_tokens), counted once before the steps;
        rows_total: its sequences (a Target.loss_mean of "sequence" weights pieces by them);
        recipe: the trainer's logprob recipe of the recorded logprobs (runner/recipe.py; None or
        the default: the step's logprob function's)."""
        self.target, self.n_total, self.n_pieces, self.world = target, n_total, n_pieces, world
        self.rows_total = rows_total
        self.loss_fn, self.logprob_fn, _ = fns
        self.recipe = recipe if recipe is not None and not recipe.default else None
        # tpdiag's invariant cross-entropy in place of the default loss (a Target.loss stays the user's)
        self.invariant_ce = target.loss is None and self.loss_fn is not _default_loss()
        self.sum, self.lps, self.lp, self.dtype, self.parallel = None, [], None, None, True

    @contextmanager
    def piece(self, rec: Recorder, lo: Logits):
        """A piece's loss-phase records; yields the loss its backward starts from, inside the
        loss context (loss_parallel's backward must run in it too)."""
        from tpdiag.runner.logits import vocab_sharded
        from tpdiag.runner.losses import loss_context

        target = self.target
        rec.add("logits", "model", "logits", lo.logits)
        self.dtype = lo.logits.dtype
        self.parallel = vocab_sharded(lo.logits)
        with loss_context(self.world, self.parallel):
            with torch.no_grad():
                if self.recipe is None:
                    self.lp = step_lp = self.logprob_fn(lo.logits.detach(), lo.labels)
                else:
                    from tpdiag.runner.recipe import logprobs

                    # the user's recipe on the whole vocabulary, in place of the fixes' invariant
                    # vocab softmax too (rollout's rule): it is the user's function. The step's loss
                    # over several pieces is still the invariant cross-entropy's logprobs, reduced once
                    self.lp = logprobs(lo.logits.detach(), lo.labels, self.recipe)
                    several = self.n_pieces > 1 and self.invariant_ce and target.loss is None
                    step_lp = self.logprob_fn(lo.logits.detach(), lo.labels) if several else None
            rec.add("logprobs", "model", "logprobs", self.lp)
            if self.n_pieces == 1:
                loss = self.loss_fn(lo.local if target.loss is not None else lo.logits, lo.labels)
                rec.add("loss", "model", "loss", loss)
            else:
                loss = micro.piece_loss(target, self.loss_fn, lo.logits, lo.local, lo.labels, self.n_total,
                                        self.invariant_ce, self.rows_total)
                self.sum = loss.detach() if self.sum is None else self.sum + loss.detach()
                self.lps.append(step_lp)
            yield loss

    def step(self, rec: Recorder):
        """The step's loss of several pieces, per step, not per piece: the pieces' shares summed,
        as a trainer logs it; under the invariant cross-entropy the tokens' logprobs reduced
        once, in the reference's order (per token, the logprobs compare across micro-batch
        sizes)."""
        from tpdiag.runner.losses import loss_context

        loss = micro.step_loss(self.lps, self.n_total, self.dtype) if self.invariant_ce else self.sum
        with loss_context(self.world, self.parallel):
            rec.add("loss", "model", "loss", loss)
        return loss


def _default_loss():
    from tpdiag.runner.losses import default_loss

    return default_loss


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


