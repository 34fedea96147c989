"""invariant-gemm's benchmark (gemm.py): config names, bitwise invariance checks, timers."""
from __future__ import annotations

import time

import torch

from tpdiag.kernels.invariant_gemm import GemmConfig

IV = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
DT_NAME = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def short(cfg: GemmConfig) -> str:
    return (f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k} g{cfg.group_m} w{cfg.num_warps} s{cfg.num_stages}"
            + (" tma" if cfg.tma else " ptr") + (" flat" if cfg.flatten else "")
            + (" ws" if cfg.warp_specialize else "") + (" sub" if cfg.epilogue_subtile else "")
            + ("" if cfg.fp32_precision == "ieee" else f" {cfg.fp32_precision}"))


def prec_group(dt: torch.dtype, cfg: GemmConfig) -> str:
    """The sweep picks a best config per group: fp32 per precision, other dtypes one group."""
    return f"fp32 {cfg.fp32_precision}" if dt == torch.float32 else DT_NAME[dt]


def bits_equal(x: torch.Tensor, y: torch.Tensor) -> bool:
    return x.shape == y.shape and torch.equal(x.contiguous().view(IV[x.dtype]), y.contiguous().view(IV[y.dtype]))


def timer(smoke: bool):
    if smoke:
        def bench(fn):
            fn()
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e3
        return bench
    import triton.testing

    return lambda fn: triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def rel_err(c: torch.Tensor, ref: torch.Tensor) -> float:
    return ((c.double() - ref).norm() / ref.norm()).item()


def invariance(mm, a: torch.Tensor, b: torch.Tensor, w: torch.Tensor) -> dict:
    """Bitwise row and column-shard invariance of ``mm``; b is [K, N], w is [N, K]."""
    M, N = a.shape[0], b.shape[1]
    full = mm(a, b)
    row_slices = sorted({(0, 1), (0, 7), (3, 100), (M // 4, M // 4 + 517), (0, M // 2), (M - 1, M), (1, M)})
    row_slices = [(i, min(j, M)) for i, j in row_slices if i < min(j, M)]
    rows = {f"{i}:{j}": bits_equal(mm(a[i:j], b), full[i:j]) for i, j in row_slices}
    cols = {}
    for tp in (2, 4, 8):
        s = N // tp
        cols[f"{tp}-way"] = all(bits_equal(mm(a, b[:, r * s:(r + 1) * s]), full[:, r * s:(r + 1) * s]) for r in range(tp))
    odd = (3, min(N, 3 + N // 3))  # unaligned column range
    cols["odd"] = bits_equal(mm(a, b[:, odd[0]:odd[1]]), full[:, odd[0]:odd[1]])
    # Linear layout: B = W.t(), column-parallel shards are row blocks of W.
    full_w = mm(a, w.t())
    wcols = {}
    for tp in (2, 4, 8):
        s = N // tp
        wcols[f"{tp}-way"] = all(bits_equal(mm(a, w[r * s:(r + 1) * s].t()), full_w[:, r * s:(r + 1) * s]) for r in range(tp))
    return {"rows": rows, "cols": cols, "weight_cols": wcols,
            "all": all(rows.values()) and all(cols.values()) and all(wcols.values()),
            "layout_equal": bits_equal(full, full_w) if torch.equal(w.t(), b) else None}


def summarize(inv: dict) -> str:
    bad = [f"rows {k}" for k, v in inv["rows"].items() if not v]
    bad += [f"cols {k}" for k, v in inv["cols"].items() if not v]
    bad += [f"W-rows {k}" for k, v in inv["weight_cols"].items() if not v]
    n = len(inv["rows"]) + len(inv["cols"]) + len(inv["weight_cols"])
    return "yes (all %d checks)" % n if not bad else "NO: %d/%d differ (%s)" % (len(bad), n, ", ".join(bad))
