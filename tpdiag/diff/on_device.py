"""Where the diff's float64 work runs: on the device the compare's parent checks record hashes on
(records/hashing.checks_on - the first GPU where its compute mode lets the parent share it, never
under fork; TPDIAG_CHECK_DEVICE=cpu: the host), else on the host. The Linear bound's float64 GEMMs
and the float64 verdicts' norms were ~10 s of a llama-1b second-pass diff on an H200 host's CPU.

What runs is the same arithmetic on either device: IEEE float64 products, sums and norms, whose
last bits may differ with the device's summation order (GEMM blocking, reduction trees) - far
below any threshold they are held against (a bound's slack is gamma_K and (T+1) u_out, a verdict's
margin A = 8 roundings). Without a device (CPU runs, every test here) nothing moves: the host path
is the one that ran before. A device that runs out of memory hands the work back to the host."""
from __future__ import annotations

import torch

_MIN = 1 << 20  # bytes: below this a copy costs more than the host's float64 work


def device():
    """The check device, or None (the host); TPDIAG_DIFF_FLOAT64=cpu: the host for this work only,
    the hashes still where checks_on put them (the A/B of this file on a GPU host)."""
    import os

    from tpdiag.records.hashing import check_device

    return None if os.environ.get("TPDIAG_DIFF_FLOAT64", "auto") == "cpu" else check_device()


def run(fn, *tensors):
    """fn(*tensors) on the check device (every tensor moved there where one holds _MIN bytes or
    more; None as it is), the result as fn gives it; on the host where there is none or it is full."""
    dev = device()
    if dev is None or not any(isinstance(t, torch.Tensor) and t.numel() * t.element_size() >= _MIN for t in tensors):
        return fn(*tensors)
    try:
        return fn(*(t.to(dev) if isinstance(t, torch.Tensor) else t for t in tensors))
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        return fn(*tensors)


def release() -> None:
    """GPU 0's cached blocks back to the worlds that run after this diff."""
    dev = device()
    if dev is not None and torch.device(dev).type == "cuda":
        torch.cuda.empty_cache()
