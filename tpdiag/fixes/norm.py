"""Install the TP-invariant RMSNorm on the modules the plan marks sequence-parallel, and on
per-head norms whose weight grad the plan all-reduces (transformers' q_norm/k_norm).

Applied at TP=1 too (same plan, same canonical order). Only RMSNorm-like modules (a `weight`
of the hidden size and an `eps`/`variance_epsilon`, no bias) are handled; anything else under
a SequenceParallel style is refused in one line rather than silently left stock.
"""
from __future__ import annotations

from contextlib import contextmanager

from torch import nn

from tpdiag.errors import BadInput
from tpdiag.kernels import tree
from tpdiag.kernels.norm_grad import RMSNormSP


def _eps(mod) -> float | None:
    for attr in ("eps", "variance_epsilon"):
        if isinstance(getattr(mod, attr, None), float):
            return getattr(mod, attr)
    return None


@contextmanager
def norm_fix(model: nn.Module, plan: dict, world: int):
    from torch.distributed.tensor import DTensor, Shard

    from tpdiag.records.styles import style_of

    wrapped = []
    try:
        for name, mod in model.named_modules():
            style = style_of(name, plan or {})
            if style not in ("sequence", "replicatedwithgradallreduce"):
                continue
            # sequence parallel: tokens sharded on dim 1; a per-head norm (transformers'
            # replicated_with_grad_allreduce, Qwen3's q_norm/k_norm): heads sharded on dim -2
            gdim = 1 if style == "sequence" else -2
            eps = _eps(mod)
            if eps is None or getattr(mod, "bias", None) is not None or not hasattr(mod, "weight"):
                raise BadInput(f"--fix invariant-norm-grad: {name} ({type(mod).__name__}) is not an "
                               "RMSNorm; only RMSNorm is supported")

            def forward(x, _mod=mod, _eps=eps, _name=name, _gdim=gdim, _style=style):
                xl = x.to_local() if isinstance(x, DTensor) else x
                what = "sequence length" if _gdim == 1 else "heads"
                groups = tree.check(xl.shape[_gdim] * world, world, f"{_name} ({what})")
                w = _mod.weight
                wl = w.to_local() if isinstance(w, DTensor) else w
                y = RMSNormSP.apply(xl, wl, _eps, groups // world, _gdim)
                if isinstance(w, DTensor) and _style == "sequence":
                    return DTensor.from_local(y, w.device_mesh, [Shard(1)], run_check=False)
                return y

            mod.forward = forward
            wrapped.append(mod)
        from tpdiag.fixes import state

        with state.flag("invariant-norm-grad"):  # read by the hf: grad all-reduce hook
            yield
    finally:
        for mod in wrapped:
            mod.__dict__.pop("forward", None)
