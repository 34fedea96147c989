"""`python -m benchmarks oracle-threshold [SEEDS]`: how small a planted error the float64
verdict (tpdiag/diff/oracle.py) still calls a bug, per dtype and record size, on CPU.

Each case is a linear layer's output y = x @ w^T (K = 512) with n outputs. The reference is
the plain product rounded to the dtype; TP=2 is the same product with K split over two ranks,
each partial rounded to the dtype and summed (a correct reordering); the planted mistake scales
TP=2's output by (1 + eps) - everywhere ("scale": a wrong 1/sqrt(d), a loss divided by the wrong
count) or on one column block of 8 ("one head": a wrong per-head slope). For eps = 2**-1 ..
2**-30, judge() is asked; the table gives, per case, the smallest eps with every larger eps
called a bug, as the worst over SEEDS seeds, under the shipped margin A(n) and under the fixed
A = 8 it replaced; and the correct reordering's largest ratio to the threshold (a twin: < 1).
"""
from __future__ import annotations

import sys

import torch

SIZES = ((4, 4), (16, 16), (64, 128))  # rows x outputs: n = 16, 256, 8192
KINDS = ("scale", "one head")
EPS = [2.0 ** -k for k in range(1, 31)]


def _case(dtype, rows, cols, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 512, generator=g).to(dtype)
    w = (torch.randn(cols, 512, generator=g) / 512 ** 0.5).to(dtype)
    exact = x.double() @ w.double().t()
    ref = (x.float() @ w.float().t()).to(dtype)
    parts = [(x[:, r * 256:(r + 1) * 256].float() @ w[:, r * 256:(r + 1) * 256].float().t()).to(dtype)
             for r in range(2)]
    tp2 = (parts[1].float() + parts[0].float()).to(dtype)
    return exact, ref, tp2


def _planted(tp2, kind, eps):
    scale = torch.ones(tp2.shape[-1], dtype=torch.float64)
    if kind == "scale":
        scale += eps
    else:
        scale[: max(1, tp2.shape[-1] // 8)] += eps
    return (tp2.double() * scale).to(tp2.dtype)


def _smallest(ok) -> float:
    """The smallest eps such that it and every larger one are called a bug (1.0: none is)."""
    out = 1.0
    for eps in EPS:  # decreasing
        if not ok(eps):
            break
        out = eps
    return out


def measure(seeds: int = 5) -> list[dict]:
    from tpdiag.diff import oracle

    rows_out = []
    for dtype in (torch.float32, torch.bfloat16):
        for rows, cols in SIZES:
            n = rows * cols
            for kind in KINDS:
                worst_new = worst_old = 0.0
                twin = 0.0
                for seed in range(seeds):
                    exact, ref, tp2 = _case(dtype, rows, cols, seed)
                    twin = max(twin, oracle.judge(ref, tp2, exact)["ratio"])

                    def far(eps, fixed=None):
                        v = oracle.judge(ref, _planted(tp2, kind, eps), exact)
                        if fixed is None:
                            return v["far"]
                        return v["ratio"] * v["margin"] > fixed  # e_N / level > A
                    worst_new = max(worst_new, _smallest(far))
                    worst_old = max(worst_old, _smallest(lambda e: far(e, 8.0)))
                rows_out.append({"dtype": str(dtype).replace("torch.", ""), "n": n, "kind": kind,
                                 "margin": round(oracle.margin(n), 3), "smallest_bug": worst_new,
                                 "smallest_bug_A8": worst_old, "twin_ratio": round(twin, 3)})
    return rows_out


def main(argv) -> dict:
    seeds = int(argv[0]) if argv else 5
    rows = measure(seeds)
    print(f"smallest planted relative error still called a bug (worst of {seeds} seeds); "
          "twin: the correct TP=2 reordering's ratio to the threshold")
    print(f"{'dtype':<9} {'n':>5} {'error':<9} {'A(n)':>5} {'bug at >=':>10} {'with A=8':>10} {'twin':>6}")
    for r in rows:
        print(f"{r['dtype']:<9} {r['n']:>5} {r['kind']:<9} {r['margin']:>5.2f} {r['smallest_bug']:>10.2e} "
              f"{r['smallest_bug_A8']:>10.2e} {r['twin_ratio']:>6.3f}")
    ok = all(r["twin_ratio"] < 1 for r in rows)
    return {"ok": ok, "seeds": seeds, "rows": rows}


if __name__ == "__main__":
    main(sys.argv[1:])
