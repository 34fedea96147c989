"""Small helpers the probes jobs share."""
from __future__ import annotations


def seconds(fn, rep: int) -> float:
    """Median seconds of fn (triton.testing.do_bench, L2 flushed per rep)."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=rep) / 1e3


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
