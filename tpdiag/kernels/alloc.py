"""Buffers the next kernel, collective or copy writes before anything reads them: no
deterministic-mode fill.

Under `torch.use_deterministic_algorithms(True)` torch fills every `empty` with NaN
(`torch.utils.deterministic.fill_uninitialized_memory`) so that a kernel reading memory it never
wrote gives the same bits run to run. The fixes' buffers are written element by element before
anything reads them (a GEMM's C, a collective's receive buffer, an `out=` add), so the fill is a
pass over memory that buys nothing: on llama-1b bf16 at 8 x 4096, TP=2, H100, the fixes' own
fills were ~21 ms of a ~620 ms step (benchmarks/trace_gaps.py on a fix-cost trace). Full capture's
host chunks (probes/host_store.py) are the same case, and a large one: each 128 MiB chunk was filled
whole (~0.1 s of CPU a chunk on the 2-core CI machine, every rank of every world, and every page of
it resident) though a record's copy writes only the bytes it reads back. The user's setting is
restored at once; every other allocation keeps it.
"""
from __future__ import annotations

import torch

_get = torch._C._get_deterministic_fill_uninitialized_memory
_set = torch._C._set_deterministic_fill_uninitialized_memory


def empty(*shape, dtype, device=None, pin_memory: bool = False) -> torch.Tensor:
    if not _get():
        return torch.empty(*shape, dtype=dtype, device=device, pin_memory=pin_memory)
    _set(False)
    try:
        return torch.empty(*shape, dtype=dtype, device=device, pin_memory=pin_memory)
    finally:
        _set(True)


def empty_like(t: torch.Tensor) -> torch.Tensor:
    return empty(t.shape, dtype=t.dtype, device=t.device)
