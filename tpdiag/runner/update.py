"""A step's backward and its optimizer step."""
from __future__ import annotations


def backward(phases, loss) -> None:
    """A piece's backward: its grads' records are the backward phase's (called inside the loss
    context: loss_parallel's backward must run in it)."""
    with phases("backward"):
        loss.backward()


def optimizer_step(phases, rec, model, opt, norm_fn, clip_norm, plan, include, buffers=None):
    """The grads' global norm (clipped if asked), the optimizer's step, the params' records and
    those of the buffers the step wrote (buffers: model_walk.buffer_state at the step's start);
    returns the norm."""
    from tpdiag.probes.model_walk import record_params, record_written_buffers
    from tpdiag.runner.per_rank import norm_over_ranks

    with phases("optimizer", last="params") as ph:
        params = list(model.parameters())
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
