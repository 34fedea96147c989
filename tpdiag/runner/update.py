"""A step's backward and its optimizer step."""
from __future__ import annotations


def backward(phases, loss) -> None:
    """A piece's backward: its grads' records are the backward phase's (called inside the loss
    context: loss_parallel's backward must run in it)."""
    with phases("backward"):
        loss.backward()


# AdamW's eps, raised per parameter dtype to that dtype's smallest normal where it is larger (optimizer)
ADAM_EPS = 1e-8


def optimizer(model, lr: float):
    """The step's AdamW (single-tensor), its eps at least the smallest normal of each parameter's dtype.
    Its state and update run in the parameter's dtype: in float16 the default eps 1e-8 rounds to 0 (the
    smallest subnormal is 6e-8), and a grad element that is 0, or so small that (1 - beta2) g^2
    underflows (|g| < ~8e-3), leaves the second moment 0 - m / (sqrt(v) + eps) was 0/0 or m/0, and the
    update wrote NaN or Inf into every float16 run's weights at every degree, the reference's too
    (tests/models/planted/tied_vocab.py:tied_ok read NON-FINITE at its first optimizer step: a correct
    model, the tool's own optimizer). float32 and bfloat16 (float32's exponent range) keep 1e-8."""
    import torch

    groups: dict = {}
    for p in model.parameters():
        groups.setdefault(p.dtype, []).append(p)
    return torch.optim.AdamW([{"params": ps, "eps": max(ADAM_EPS, torch.finfo(dt).tiny if dt.is_floating_point else 0.0)}
                              for dt, ps in groups.items()], lr=lr, foreach=False)


def optimizer_step(phases, rec, model, opt, norm_fn, clip_norm, plan, include, buffers=None):
    """The grads' global norm (clipped if asked), the optimizer's step, the params' records and
    those of the buffers the step wrote (buffers: model_walk.buffer_state at the step's start);
    returns the norm."""
    from tpdiag.base.sparse import densify_grads
    from tpdiag.probes.model_walk import record_params, record_written_buffers
    from tpdiag.runner.per_rank import norm_over_ranks

    with phases("optimizer", last="params") as ph:
        params = list(model.parameters())
        # nn.Embedding(sparse=True): this step is tpdiag's AdamW whatever the user's optimizer (SparseAdam's
        # lazy rows are not it), run on the dense grad the backward's record holds
        densify_grads(params)
        # every rank alike (mark_params' count), not this rank's own marks: the norm's all-reduce
        if getattr(rec, "per_rank_params", 0):
            total = norm_over_ranks(params, norm_fn, clip_norm)  # an expert-parallel model's own experts
        else:
            total = norm_fn(params, clip_norm)
        rec.add("grad_norm", "model", "total", total)
        ph.lap("clip")
        opt.step()
        opt.zero_grad(set_to_none=True)
        ph.lap("optimizer")
        record_params(rec, model, "param", plan, include)
        from tpdiag.probes.own_params import mark_recorded

        mark_recorded(model)
        if buffers is not None:
            record_written_buffers(rec, model, buffers, plan, include)
    return total
