"""`python -m benchmarks hash-collisions [TRIALS]`: the record hash's lane mixes under the
perturbations TP runs produce, on CPU (numpy; `git show d055ef2:docs/benchmarks.md`, "A shorter lane mix").

Table 1: T trials of a [16, 32] bf16 tensor (randn) and a perturbed copy; how often an 8-bit
window of a lane (bits 0-7, 12-19, 24-31 of lane_a and lane_b) is unchanged, and the pair
(low 4 bits of both lanes; high 4 bits of both). A random function: T / 256 each.
Table 2: two-element perturbations (their lane difference needs only the two elements, so
millions of trials): P(low b bits of the lane difference are 0) * 2**b for b = 8, 16, 20 (1.0:
a random function), lane_a's top 16 bits, P(all 32 bits of lane_a unchanged), lane_b's low bits,
and the joint low 8 + 8 bits.

Mixes (y = w * C1 + k * C2): v1 (the first mix; lane_b sum x*x), v2 (shipped; lane_b sum x*y),
and rejected ones for scale: one xorshift (x = y ^ y >> 16, lane_b x*y), a linear control (x = y,
lane_b x*x), and "16-bit pairs" (session 11: v2's mix with y = floor(w * (C1 for even k, C3 for
odd) / 2**16) + (k >> 1) * C2, which a kernel computes for two bf16 elements from one 32-bit word
in fewer integer ops - measured +3% bandwidth on an H200, not worth a format change:
`git show d055ef2:docs/benchmarks.md`, "Session 11").
"""
from __future__ import annotations

import sys

import numpy as np

U = np.uint32
C1, C2, C3 = U(0x9E3779B1), U(0x85EBCA77), U(0x85EBCA6B)


def _rot(y, r):
    return (y << U(r)) | (y >> U(32 - r))


def _v1(y):
    x = y ^ (y >> U(16))
    x = x * C3
    x = x ^ (x >> U(15))
    return x, x


def _v2(y):
    from tpdiag.kernels.record_hash_ref import R1, R2

    return y ^ _rot(y, R1) ^ _rot(y, R2), y


def _y2(w, k):
    return w * C1 + k * C2


def _y_pairs(w, k):
    c = np.where(k & U(1), np.uint64(C3), np.uint64(C1))
    return ((w.astype(np.uint64) * c) >> np.uint64(16)).astype(U) + (k >> U(1)) * C2


# name -> (mix, y of 16-bit words w at indices k)
MIXES = {"v1 (first)": (_v1, _y2), "v2 (shipped)": (_v2, _y2),
         "one xorshift": (lambda y: (y ^ (y >> U(16)), y), _y2), "linear (control)": (lambda y: (y, y), _y2),
         "16-bit pairs (rejected)": (_v2, _y_pairs)}
CLASSES = ("+-1 ULP x2, balanced", "+-1 ULP x16, balanced", "+-1 ULP x64, random signs", "2 elements swapped",
           "2 adjacent swapped", "row permutation", "1 sign flip", "sign of every element", "shard offset +1",
           "tensor rolled by 1", "2 random bit flips", "zero vs near-zero")


def _lanes(mix, w, k):
    mix, y = mix
    x, f = mix(y(w, k))
    return x.sum(axis=1, dtype=U), (x * f).sum(axis=1, dtype=U)


def _perturb(name, rng, T, R=16, C=32):
    N = R * C
    w = (rng.standard_normal((T, N)).astype(np.float32).view(U) >> U(16)).astype(U)
    k = np.broadcast_to(np.arange(N, dtype=U), (T, N))
    w2, k2, t0, ti = w.copy(), k, np.arange(T), np.arange(T)[:, None]
    if "ULP" in name:
        m = int(name.split("x")[1].split(",")[0])
        idx = np.argsort(rng.random((T, N)), axis=1)[:, :m]
        d = np.where(np.arange(m) % 2 == 0, 1, -1) if "balanced" in name else rng.choice([-1, 1], (T, m))
        w2[ti, idx] = (w2[ti, idx].astype(np.int64) + d).astype(U) & U(0xFFFF)
    elif "swapped" in name:
        if "adjacent" in name:
            i0 = rng.integers(0, N - 1, T)
            i1 = i0 + 1
        else:
            i0, i1 = np.argsort(rng.random((T, N)), axis=1)[:, :2].T
        a, b = w2[t0, i0].copy(), w2[t0, i1].copy()
        w2[t0, i0], w2[t0, i1] = b, a
    elif name == "row permutation":
        w2 = w.reshape(T, R, C)[ti, np.argsort(rng.random((T, R)), axis=1)].reshape(T, N)
    elif name == "1 sign flip":
        w2[t0, rng.integers(0, N, T)] ^= U(0x8000)
    elif name == "sign of every element":
        w2 = w ^ U(0x8000)
    elif name == "shard offset +1":
        k2 = k + U(1)
    elif name == "tensor rolled by 1":
        w2 = np.roll(w, 1, axis=1)
    elif name == "2 random bit flips":
        idx = np.argsort(rng.random((T, N)), axis=1)[:, :2]
        w2[ti, idx] ^= U(1) << rng.integers(0, 16, (T, 2)).astype(U)
    elif name == "zero vs near-zero":
        w = np.zeros((T, N), U)
        sel = rng.random((T, N)) < (rng.integers(1, N, T)[:, None] / N)
        w2 = np.where(sel, np.where(rng.random((T, N)) < .5, U(0x8000), U(1)), U(0)).astype(U)
    keep = ~((w == w2) & (k == k2)).all(axis=1)  # no change at all is not a perturbation
    return w[keep], k[keep], w2[keep], k2[keep]


def table1(T: int, seed: int = 1) -> list[str]:
    rng = np.random.default_rng(seed)
    lines = [f"T = {T} trials per class ({T / 256:.0f} +- {(T / 256) ** .5:.0f} expected per column)",
             "| perturbation | mix | lane_a 0-7 | 12-19 | 24-31 | lane_b 0-7 | 12-19 | 24-31 | pair low 4+4 | pair high 4+4 | worst / random |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for cls in CLASSES:
        w, k, w2, k2 = _perturb(cls, rng, T)
        n = len(w)
        for name, mix in MIXES.items():
            a1, b1 = _lanes(mix, w, k)
            a2, b2 = _lanes(mix, w2, k2)
            da, db = a1 ^ a2, b1 ^ b2
            cols = [int((((d >> U(lo)) & U(255)) == 0).sum()) for d in (da, db) for lo in (0, 12, 24)]
            cols += [int((((da | db) & U(15)) == 0).sum()), int((((da | db) >> U(28)) == 0).sum())]
            lines.append(f"| {cls} | {name} | " + " | ".join(map(str, cols)) + f" | {max(cols) / (n / 256):.1f}x |")
    return lines


def table2(n: int, seed: int = 5) -> list[str]:
    rng = np.random.default_rng(seed)
    lines = [f"{n} trials per class; P(low b bits of the lane difference = 0) x 2**b (1.0 = random)",
             "| perturbation | mix | lane_a b=8 | b=16 | b=20 | lane_a top 16 bits | lane_a all 32: P | lane_b b=8 | b=16 | both lanes 8+8 bits |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    bf = lambda: (rng.standard_normal(n).astype(np.float32).view(U) >> U(16)).astype(U)  # noqa: E731
    for cls in ("2 elements swapped", "2 adjacent swapped", "+-1 ULP x2, balanced", "2 random bit flips",
                "2 sign flips"):
        w1, w2 = bf(), bf()
        k1 = rng.integers(0, 1 << 20, n).astype(U)
        k2 = k1 + U(1) if "adjacent" in cls else rng.integers(0, 1 << 20, n).astype(U)
        if "swapped" in cls:
            ok, a1, a2 = w1 != w2, w2, w1
        elif "ULP" in cls:
            ok, a1, a2 = np.ones(n, bool), (w1 + U(1)) & U(0xFFFF), (w2 - U(1)) & U(0xFFFF)
        elif "sign" in cls:
            ok, a1, a2 = np.ones(n, bool), w1 ^ U(0x8000), w2 ^ U(0x8000)
        else:
            ok = np.ones(n, bool)
            a1 = w1 ^ (U(1) << rng.integers(0, 16, n).astype(U))
            a2 = w2 ^ (U(1) << rng.integers(0, 16, n).astype(U))
        ok &= k1 != k2  # both changes on one element: another class (or no change at all)
        m = int(ok.sum())
        for name, (mix, y) in MIXES.items():
            if name.startswith("linear"):
                continue
            (x1, f1), (x2, f2) = mix(y(w1, k1)), mix(y(w2, k2))
            (y1, g1), (y2, g2) = mix(y(a1, k1)), mix(y(a2, k2))
            da = (y1 + y2 - x1 - x2)[ok]
            db = (y1 * g1 + y2 * g2 - x1 * f1 - x2 * f2)[ok]
            r = lambda d, b: ((d & U((1 << b) - 1)) == 0).sum() / m * 2 ** b  # noqa: E731
            top = ((da >> U(16)) == 0).sum() / m * 2 ** 16
            joint = (((da & U(255)) == 0) & ((db & U(255)) == 0)).sum() / m * 2 ** 16
            full = (da == 0).sum() / m
            lines.append(f"| {cls} | {name} | {r(da, 8):.2f} | {r(da, 16):.2f} | {r(da, 20):.1f} | {top:.2f} | "
                         f"{full:.1e} | "
                         f"{r(db, 8):.2f} | {r(db, 16):.2f} | {joint:.2f} |")
    return lines


def main(argv) -> None:
    T = int(argv[0]) if argv else 20000
    n = int(argv[1]) if len(argv) > 1 else 4_000_000
    with np.errstate(over="ignore"):
        print("\n".join(table1(T)))
        print()
        print("\n".join(table2(n)))


if __name__ == "__main__":
    main(sys.argv[1:])
