"""Candidate AttnConfigs of invariant attention side by side with the stock SDPA backends, at
head_dim 64 and 128 in one process (issue 59 item 4: <= 1.05x of the fastest stock SDPA at D=64).

    python -m benchmarks attention --configs d64 [--budget-s 300] [--rounds 3] [--json PATH]
    python -m benchmarks attention --configs d64 --smoke [--only fused,q64]   # CPU, interpreter

Sizes: D=64 at the job's --batch/--heads/--seq (B8 H32 S4096), D=128 at half the batch and heads
(B4 H16: the shape docs/benchmarks.md's D=128 figures use); bf16, causal. Each candidate is the
shipped config of its head dim (attention_triton.config_for) with some fields changed
(CANDIDATES). Per candidate: fwd and fwd+bwd ms (do_bench medians, through invariant_sdpa and
autograd, as a model calls it), x the fastest stock backend's fwd+bwd, TFLOP/s at the usual
count (causal fwd 4*B*H*L*S*D/2, fwd+bwd 3.5x that, whatever the kernel recomputes); and
bitwise checks: the TP=2 head slices and the batch halves equal the full call's rows (the
invariance a config must keep), a rerun equals the first (reproducible), and whether its bits
equal the shipped config's (`same_bits`: expected where only warps, stages, launch groups, TMA,
the fused launch, the row tiles of the forward and the dq pass or the key tile of the dk/dv pass
change; a different key block of the forward (fwd_n), query block of the dk/dv pass (kv_m) or key
block of the dq pass (q_n) regroups a sum and may change the bits - still invariant, as every TP
degree and batch takes the same config).
Then "combo": the fastest forward-only change with the fastest backward-only change (each faster
than the shipped config's pass), checked and timed as a candidate. Then the three fastest
candidates, the shipped config and the fastest stock backend are timed again, interleaved,
`--rounds` times (the medians are the figures to read). Candidates not reached within
--budget-s (compiles dominate) are listed as skipped. The table's last line is the
AttnConfig to put in HEAD_DIM_CONFIGS for the fastest invariant candidate.
"""
from __future__ import annotations

import dataclasses
import json
import math
import statistics
import time

# (name, head dims, AttnConfig fields changed from that head dim's shipped config). Ordered by
# what the last sweeps and public tunings suggest (docs/benchmarks.md, "Invariant attention"): the
# budget may end the list early. "tutorial": the backward tiles of Triton's fused-attention
# tutorial (dk/dv 32 query rows x 128 keys, dq 128 rows x 32 keys, 4 warps, 5 stages).
TUTORIAL = {"kv_m": 32, "kv_n": 128, "kv_warps": 4, "kv_stages": 5, "q_m": 128, "q_n": 32, "q_warps": 4, "q_stages": 5}
CANDIDATES = [
    ("fused", (64,), {"bwd_fused": 1}),
    # the two-launch recompute backward (the D=64 entry before 2ff413b): fused vs not side by side
    ("two-launch", (64,), {"bwd_fused": 0}),
    ("fused+fw4+tma", (64,), {"bwd_fused": 1, "fwd_warps": 4, "bwd_tma": 1}),
    ("fw4+tma", (64,), {"fwd_warps": 4, "bwd_tma": 1}),
    # dS of every 2nd / 4th key block stored, the rest recomputed by dq (ds_every): half or a
    # quarter of the dS traffic for half or three quarters of the recompute
    ("mix-2", (64,), {"ds_mib": 2048, "ds_every": 2, "kv_group": 4, "q_group": 4}),
    ("mix-4", (64,), {"ds_mib": 2048, "ds_every": 4, "kv_group": 4, "q_group": 4}),
    ("mix-2-tma", (64,), {"ds_mib": 2048, "ds_every": 2, "bwd_tma": 1, "kv_group": 4, "q_group": 4}),
    ("tutorial", (64,), TUTORIAL),
    ("tutorial-s3", (64,), {**TUTORIAL, "kv_stages": 3, "q_stages": 3}),
    ("fused+tutorial", (64,), {**TUTORIAL, "bwd_fused": 1}),
    ("fw4+tma+groups4", (64,), {"fwd_warps": 4, "bwd_tma": 1, "fwd_group": 4, "kv_group": 4, "q_group": 4}),
    ("fused+fw4+tma+groups4", (64,), {"bwd_fused": 1, "fwd_warps": 4, "bwd_tma": 1, "fwd_group": 4,
                                      "kv_group": 4, "q_group": 4}),
    ("fused-s2", (64,), {"bwd_fused": 1, "kv_stages": 2}),
    ("fused-w8", (64,), {"bwd_fused": 1, "kv_warps": 8, "q_warps": 8}),
    ("fwd128x128", (64,), {"fwd_n": 128}),
    ("fwd128x128w4", (64,), {"fwd_n": 128, "fwd_warps": 4}),
    ("fwd-s4", (64,), {"fwd_stages": 4}),
    ("fwd-s2", (64,), {"fwd_stages": 2}),
    ("kv-s2", (64,), {"kv_stages": 2}),
    ("kv-s4", (64,), {"kv_stages": 4}),
    ("q-s2", (64,), {"q_stages": 2}),
    ("q-w8", (64,), {"q_warps": 8}),
    ("q64", (64,), {"q_m": 64}),
    ("q128x128w8", (64,), {"q_n": 128, "q_warps": 8, "q_stages": 2}),
    ("kv32x128w8", (64,), {"kv_m": 32, "kv_n": 128, "kv_warps": 8}),
    ("ds-2048", (64,), {"ds_mib": 2048, "bwd_tma": 1, "kv_group": 4, "q_group": 4}),
    # chunks of 4 and 16 heads: a chunk's dS (16 MiB a head, causal) nearer to fitting L2 when the
    # dq pass reads it back - no new compile (ds_mib is no kernel constant)
    ("ds-128", (64,), {"ds_mib": 128, "bwd_tma": 1, "kv_group": 4, "q_group": 4}),
    ("ds-512", (64,), {"ds_mib": 512, "bwd_tma": 1, "kv_group": 4, "q_group": 4}),
    ("fwd-s2@128", (128,), {"fwd_stages": 2}),
    # exp2 partly by a polynomial on the FMA pipe (AttnConfig.exp_soft, kernels/exp2_soft.py):
    # bits 1 the dq loop, 2 the dk/dv loop, 4 the forward; a quarter (every 4) or half (every 2) of
    # a tile's columns; degree 3 unless named. Other bits than the shipped config's (still
    # invariant). The quarters first: at the shipped tiles they balance MUFU lanes and issue slots
    # per tensor clock best (`--sass`: dq 0.5 / 0.73-0.93 against 0.67 / 0.58-0.78 shipped)
    ("soft-dq-q", (64,), {"exp_soft": 1, "exp_soft_every": 4}),
    ("soft-both-q", (64,), {"exp_soft": 3, "exp_soft_every": 4}),
    ("soft-dq", (64,), {"exp_soft": 1, "exp_soft_every": 2}),
    ("soft-both", (64,), {"exp_soft": 3, "exp_soft_every": 2}),
    ("soft-kv", (64,), {"exp_soft": 2, "exp_soft_every": 2}),
    ("soft-both-d5", (64,), {"exp_soft": 3, "exp_soft_every": 2, "exp_soft_deg": 5}),
    ("soft-all-q", (64,), {"exp_soft": 7, "exp_soft_every": 4}),
    # hattn15 (issue 59 item 4): TMA loads of K and V in the dq recompute loop (dq_tma); the
    # backward passes persistent, programs taking tiles heaviest first from a counter (kv_persist,
    # q_persist: programs per SM); with the dk/dv loop's TMA loads and 4-head launch groups
    # (D=128's), and with the tiles and stages the earlier sweeps found nearest the shipped ones.
    # The same bits as the shipped config wherever the tiles are
    ("dq-tma", (64,), {"dq_tma": 1}),
    ("bwd-tma-all", (64,), {"dq_tma": 1, "bwd_tma": 1}),
    ("tma-all+groups4", (64,), {"dq_tma": 1, "bwd_tma": 1, "fwd_group": 4, "kv_group": 4, "q_group": 4}),
    ("kvp1", (64,), {"kv_persist": 1}),
    ("kvp2", (64,), {"kv_persist": 2}),
    ("kvp2+qp2", (64,), {"kv_persist": 2, "q_persist": 2}),
    ("kvp2+tma", (64,), {"kv_persist": 2, "dq_tma": 1, "bwd_tma": 1}),
    ("kvp2+tma+groups4", (64,), {"kv_persist": 2, "dq_tma": 1, "bwd_tma": 1, "fwd_group": 4, "kv_group": 4,
                                 "q_group": 4}),
    ("kvp2+tma+q64", (64,), {"kv_persist": 2, "dq_tma": 1, "bwd_tma": 1, "q_m": 64}),
    ("kvp2+tma+kv-s4", (64,), {"kv_persist": 2, "dq_tma": 1, "bwd_tma": 1, "kv_stages": 4}),
    ("kvp2+tma+fwd-s4", (64,), {"kv_persist": 2, "dq_tma": 1, "bwd_tma": 1, "fwd_stages": 4}),
    # register caps (kv_maxnreg, q_maxnreg): more programs per SM at smaller query tiles - the
    # dk/dv program at kv_m = 32 takes 221 registers (2 a SM), 168 under the cap (3), 128 (4);
    # the dq program at q_m = 64 136 (3), 128 (4 where 2 stages leave the shared memory)
    ("kv32", (64,), {"kv_m": 32}),
    ("kv32-r168", (64,), {"kv_m": 32, "kv_maxnreg": 168}),
    ("kv32-r128", (64,), {"kv_m": 32, "kv_maxnreg": 128}),
    ("q64-r128", (64,), {"q_m": 64, "q_maxnreg": 128}),
    ("q64-r128-s2", (64,), {"q_m": 64, "q_maxnreg": 128, "q_stages": 2}),
    ("kv32-r168+q64-r128-s2", (64,), {"kv_m": 32, "kv_maxnreg": 168, "q_m": 64, "q_maxnreg": 128, "q_stages": 2}),
    ("kv32-r168+kvp3", (64,), {"kv_m": 32, "kv_maxnreg": 168, "kv_persist": 3}),
    ("kv32-r168+q64-r128-s2+tma", (64,), {"kv_m": 32, "kv_maxnreg": 168, "q_m": 64, "q_maxnreg": 128, "q_stages": 2,
                                           "dq_tma": 1, "bwd_tma": 1}),
    # the dk/dv loop in interleaved halves (kv_split): one half's exp2 and dS beside the other's
    # products
    ("kv-split", (64,), {"kv_split": 1}),
    # the D=64 entry before hattn15 (no backward TMA loads, head-by-head launches)
    ("d64-before", (64,), {"dq_tma": 0, "bwd_tma": 0, "fwd_group": 1, "kv_group": 1, "q_group": 1}),
    ("kv-split+tma+groups4", (64,), {"kv_split": 1, "dq_tma": 1, "bwd_tma": 1, "fwd_group": 4, "kv_group": 4,
                                     "q_group": 4}),
    ("kv-split+kvp2", (64,), {"kv_split": 1, "kv_persist": 2}),
    ("kv-split-s2", (64,), {"kv_split": 1, "kv_stages": 2}),
]
STOCK = ("sdpa-cudnn", "sdpa-flash", "sdpa-efficient")
# the interpreter's tiles (--smoke): small, so a candidate's changes still fit (multiples kept)
SMOKE_TILES = dict(fwd_m=32, fwd_n=16, kv_m=16, kv_n=32, q_m=32, q_n=16, fwd_tma=False)
TILE_FIELDS = ("fwd_m", "fwd_n", "kv_m", "kv_n", "q_m", "q_n")


def _smoke_changes(changes: dict) -> dict:
    """A candidate's changes at the interpreter's tiles: tile sizes a quarter (16 at least), so
    their ratios to one another - what the kernels require - hold as at full size."""
    out = {f: max(16, v // 4) if f in TILE_FIELDS else v for f, v in changes.items()}
    if out.get("kv_split"):  # halves of 16 rows at least
        out.setdefault("kv_m", 32)
    return out


def _flops(B, H, L, S, D, causal) -> float:
    return 3.5 * 4 * B * H * L * S * D * (0.5 if causal else 1.0)


def _eq(torch, a, b) -> bool:
    if a.shape != b.shape:
        return False
    it = torch.int16 if a.element_size() == 2 else torch.int32
    return torch.equal(a.contiguous().view(it), b.contiguous().view(it))


def _sync(torch, dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _run(torch, f, q, k, v, do):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    o = f(q, k, v)
    o.backward(do)
    _sync(torch, q.device)
    return o.detach(), q.grad, k.grad, v.grad


def _checks(torch, f, q, k, v, do, ref=None, tps=(2,)) -> dict:
    """Head slices at these TP degrees (where the heads divide), batch halves, a rerun; and the bits
    against `ref` (the shipped config's outputs) - each a dict over o, dq, dk, dv. TP=2 only by
    default: a head count not a multiple of 16 (H / 4 = 8 here) is another Triton specialization,
    a second compile of every kernel per candidate (benchmarks.attention checks TP=2/4/8)."""
    names = ("o", "dq", "dk", "dv")
    full = _run(torch, f, q, k, v, do)
    res = {"repro": {n: _eq(torch, a, b) for n, a, b in zip(names, _run(torch, f, q, k, v, do), full)}}
    H, Hk, B = q.shape[1], k.shape[1], q.shape[0]
    for tp in tps:
        if Hk % tp:
            continue
        ok = dict.fromkeys(names, True)
        for r in range(tp):
            hs, ks = slice(r * H // tp, (r + 1) * H // tp), slice(r * Hk // tp, (r + 1) * Hk // tp)
            part = _run(torch, f, q[:, hs], k[:, ks], v[:, ks], do[:, hs])
            for n, a, b, s in zip(names, part, full, (hs, hs, ks, ks)):
                ok[n] = ok[n] and _eq(torch, a, b[:, s])
        res[f"tp{tp}"] = ok
    if B > 1:
        ok = dict.fromkeys(names, True)
        for bs in (slice(0, B // 2), slice(B // 2, B)):
            for n, a, b in zip(names, _run(torch, f, q[bs], k[bs], v[bs], do[bs]), full):
                ok[n] = ok[n] and _eq(torch, a, b[bs])
        res["batch"] = ok
    if ref is not None:
        res["same_bits"] = {n: _eq(torch, a, b) for n, a, b in zip(names, full, ref)}
    return res


def _invariant(res: dict) -> bool:
    return all(all(d.values()) for k, d in res.items() if k != "same_bits")


def _timer(torch, smoke: bool):
    if smoke:
        def bench(fn):
            fn()
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e3
        return bench
    from triton.testing import do_bench

    return lambda fn: do_bench(fn, warmup=25, rep=200, return_mode="median")


def _fns(torch, F, causal: bool, smoke: bool):
    """(stock backends by name, inv(cfg) -> a q, k, v -> o callable with autograd)."""
    if smoke:
        from tpdiag.kernels import attention_triton as at, attention_triton_bwd as atb

        class _Tri(torch.autograd.Function):  # the kernels under the interpreter (invariant_sdpa
            @staticmethod                      # sends CPU tensors the torch way)
            def forward(ctx, q, k, v, cfg, sc):
                o, lse = at.forward(q, k, v, causal, sc, cfg)
                ctx.save_for_backward(q, k, v, o, lse)
                ctx.cfg, ctx.sc = cfg, sc
                return o

            @staticmethod
            def backward(ctx, do):
                q, k, v, o, lse = ctx.saved_tensors
                return (*atb.backward(do.contiguous(), q, k, v, o, lse, causal, ctx.sc, ctx.cfg), None, None)

        stock = {"sdpa-math": lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=causal)}
        return stock, lambda cfg: (lambda q, k, v: _Tri.apply(q, k, v, cfg, 1.0 / math.sqrt(q.shape[-1])))
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from tpdiag.kernels.attention import invariant_sdpa

    def stock(backend):
        def f(q, k, v):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return f
    backends = {"sdpa-cudnn": stock(SDPBackend.CUDNN_ATTENTION), "sdpa-flash": stock(SDPBackend.FLASH_ATTENTION),
                "sdpa-efficient": stock(SDPBackend.EFFICIENT_ATTENTION)}
    return backends, lambda cfg: (lambda q, k, v: invariant_sdpa(q, k, v, is_causal=causal, triton_cfg=cfg))


def _time(torch, bench, f, q, k, v, do):
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))

    def fb():
        f(qg, kg, vg).backward(do)
        qg.grad = kg.grad = vg.grad = None
    with torch.no_grad():
        fwd = bench(lambda: f(q, k, v))
    return fwd, bench(fb)


def run(args) -> dict:
    """args: the attention job's (batch, heads, seq, no_causal, configs, budget_s, rounds, smoke,
    json)."""
    import os

    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
    else:
        from benchmarks.errors import require_cuda

        require_cuda("attention --configs", "--smoke runs it on CPU under the Triton interpreter")
    import torch
    import torch.nn.functional as F
    import triton

    from benchmarks.emit import emit
    from tpdiag.kernels import attention_triton as at

    smoke, causal = args.smoke, not args.no_causal
    dev = torch.device("cpu" if smoke else "cuda")
    dt = torch.bfloat16
    dims = {"d64": (64, 128), "d64-only": (64,), "d128": (128,)}[args.configs]
    if smoke:
        sizes = {64: (2, 2, 40), 128: (2, 2, 40)}  # uneven against every tile: the masks run
    else:
        sizes = {64: (args.batch, args.heads, args.seq),
                 128: (max(1, args.batch // 2), max(1, args.heads // 2), args.seq)}
    bench = _timer(torch, smoke)
    stock_fns, inv = _fns(torch, F, causal, smoke)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "gpu": "cpu (interpreter)" if smoke else torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__, "dtype": str(dt), "causal": causal, "budget_s": args.budget_s,
            "sizes": {d: sizes[d] for d in dims}}
    print(json.dumps(meta), flush=True)
    t_start = time.time()
    result = {"meta": meta, "dims": {}}
    lines = [f"{'D':>3} {'backend / candidate':28} {'fwd ms':>8} {'fwd+bwd':>8} {'x fast':>6} {'TFLOP/s':>7} "
             f"{'inv':>4} {'same bits':>9}  changes"]
    for D in dims:
        B, H, S = sizes[D]
        g = torch.Generator(device=dev).manual_seed(0)
        q, k, v, do = (torch.randn(B, H, S, D, generator=g, device=dev).to(dt) for _ in range(4))
        flops = _flops(B, H, S, S, D, causal)
        shipped = at.config_for(dt, D)
        if smoke:
            shipped = dataclasses.replace(shipped, **SMOKE_TILES)
        rows = {}

        def row(fwd, both):
            return {"fwd_ms": fwd, "fwdbwd_ms": both, "tflops": round(flops / both / 1e9, 1)}
        for name, f in stock_fns.items():
            try:
                rows[name] = row(*_time(torch, bench, f, q, k, v, do))
            except Exception as e:  # a backend this build lacks: say so, time the rest
                rows[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"}
            print(D, name, json.dumps(rows[name]), flush=True)
        ref = _run(torch, inv(shipped), q, k, v, do)
        try:
            passes = _passes(torch, bench, q, k, v, do, shipped, causal, next(iter(stock_fns.values())))
        except Exception as e:  # the breakdown is a reading aid: its failure stops nothing
            passes = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"}
        print(D, "passes", json.dumps(passes), flush=True)
        cands = [("shipped", {})] + [(n, c) for n, ds, c in CANDIDATES
                                     if D in ds and (not args.only or n in args.only.split(","))]
        cfgs = {}

        def candidate(name, changes):
            if name != "shipped" and time.time() - t_start > args.budget_s:
                rows[f"inv:{name}"] = {"skipped": f"past --budget-s {args.budget_s}", "changes": changes}
                print(D, f"inv:{name}", "skipped (budget)", flush=True)
                return
            try:
                cfg = dataclasses.replace(shipped, **(_smoke_changes(changes) if smoke else changes))
                f = inv(cfg)
                t0 = time.time()
                r = row(*_time(torch, bench, f, q, k, v, do))
                r["checks"] = _checks(torch, f, q, k, v, do, ref)
                r["invariant"] = _invariant(r["checks"])
                r["seconds"] = round(time.time() - t0, 1)
                cfgs[name] = cfg
            except Exception as e:  # a config that does not compile (shared memory): skipped
                r = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"}
            r["changes"] = changes
            rows[f"inv:{name}"] = r
            print(D, f"inv:{name}", f"at {time.time() - t_start:.0f} s", json.dumps(r), flush=True)
            if args.json:  # what ran so far survives a call's time limit
                result["dims"][D] = {"shape": [B, H, S, D], "rows": rows, "partial": True}
                with open(args.json, "w") as fh:
                    json.dump(result, fh, indent=1, default=str)
        for name, changes in cands:
            candidate(name, changes)
        combo = _combo(rows)
        if combo:
            candidate("combo", combo)
        ok = [n for n in rows if n.startswith("inv:") and rows[n].get("invariant")]
        stock_ok = [n for n in stock_fns if "fwdbwd_ms" in rows[n]]
        fastest = min(stock_ok, key=lambda n: rows[n]["fwdbwd_ms"]) if stock_ok else None
        # interleaved rounds: the fastest few candidates, the shipped config, the fastest stock
        top = sorted((n for n in ok if n != "inv:shipped"), key=lambda n: rows[n]["fwdbwd_ms"])[:3]
        again = ([fastest] if fastest else []) + ["inv:shipped"] + top
        fns = {n: stock_fns[n] if n in stock_fns else inv(cfgs[n[4:]]) for n in again}
        rounds = {n: [] for n in again}
        for _ in range(args.rounds):
            for n in again:
                rounds[n].append(_time(torch, bench, fns[n], q, k, v, do)[1])
        for n, ts in rounds.items():
            if ts:
                rows[n]["rounds_ms"] = ts
                rows[n]["fwdbwd_ms"] = statistics.median(ts)
                rows[n]["tflops"] = round(flops / rows[n]["fwdbwd_ms"] / 1e9, 1)
        base = rows[fastest]["fwdbwd_ms"] if fastest else None
        for n, r in rows.items():
            if base and "fwdbwd_ms" in r:
                r["x_fastest_stock"] = r["fwdbwd_ms"] / base
        best = min(ok, key=lambda n: rows[n]["fwdbwd_ms"]) if ok else None
        result["dims"][D] = {"shape": [B, H, S, D], "fastest_stock": fastest, "rows": rows, "best": best,
                             "passes": passes,
                             "best_config": cfgs[best[4:]].to_dict() if best else None,
                             "shipped_config": shipped.to_dict()}
        lines += _table_lines(D, rows, passes, best, cfgs)
    result["seconds"] = round(time.time() - t_start, 1)
    result["ok"] = all(rows_ok(d) for d in result["dims"].values())
    return emit(result, lines, args.json)


def _table_lines(D: int, rows: dict, passes: dict, best: str | None, cfgs: dict) -> list[str]:
    lines = []
    for n, r in rows.items():
        if "fwdbwd_ms" not in r:
            lines.append(f"{D:3d} {n:28} {r.get('skipped') or r.get('error')}")
            continue
        c = r.get("checks", {})
        inv_s = "-" if not c else ("yes" if r["invariant"] else "NO")
        same = "-" if "same_bits" not in c else ("yes" if all(c["same_bits"].values()) else
                                                 "NO(" + ",".join(x for x, y in c["same_bits"].items() if not y) + ")")
        x = r.get("x_fastest_stock")
        lines.append(f"{D:3d} {n:28} {r['fwd_ms']:8.3f} {r['fwdbwd_ms']:8.3f} {x if x is None else round(x, 3)!s:>6} "
                     f"{r['tflops']:7.1f} {inv_s:>4} {same:>9}  {r.get('changes', '')}")
    if "error" not in passes:
        lines.append(f"{D:3d} passes (shipped tiles, recompute path; TFLOP/s of the products each runs): " + ", ".join(
            f"{n} {p['ms']:.3f} ms" + (f" {p['tflops']:.0f}" if p.get("tflops") else "") if "ms" in p
            else f"{n} {p['error']}" for n, p in passes.items()))
    if best:
        lines.append(f"{D:3d} fastest invariant: {best} - HEAD_DIM_CONFIGS entry: "
                     f"AttnConfig(**{cfgs[best[4:]].to_dict()})")
    return lines


def _passes(torch, bench, q, k, v, do, cfg, causal: bool, stock) -> dict:
    """Each pass of the recompute path at the shipped tiles alone (forward 2 block products, dq 3,
    dk/dv 4, the delta pass; the fused launch 7 after its delta pass) beside the first stock
    backend's forward and backward (5 products): ms and TFLOP/s of the products each actually
    runs - where D=64's time goes against D=128's."""
    from tpdiag.kernels import attention_triton as at, attention_triton_bwd as atb

    B, H, L, D = q.shape
    S = k.shape[2]
    unit = 2 * B * H * L * S * D * (0.5 if causal else 1.0)  # one block product over the pairs
    sc = 1.0 / math.sqrt(D)
    rec = dataclasses.replace(cfg, ds_mib=0)
    o, lse = at.forward(q, k, v, causal, sc, rec)
    _, delta = atb.dq_pass(do, q, k, v, o, lse, causal, sc, rec)
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    og = stock(qg, kg, vg)
    calls = {"fwd": (2, lambda: at.forward(q, k, v, causal, sc, rec)),
             "delta": (0, lambda: atb.delta_pass(do, o, rec)),
             "dq": (3, lambda: atb.dq_pass(do, q, k, v, o, lse, causal, sc, rec)),
             "dkdv": (4, lambda: atb.dkdv_pass(do, q, k, v, lse, delta, causal, sc, rec, loads=rec.bwd_tma)),
             "fused": (7, lambda: atb.fused_pass(do, q, k, v, o, lse, causal, sc, rec)),
             "stock-fwd": (2, lambda: stock(q, k, v)),
             "stock-bwd": (5, lambda: torch.autograd.grad(og, (qg, kg, vg), do, retain_graph=True))}
    out = {}
    for n, (products, fn) in calls.items():
        try:
            ms = bench(fn)
        except Exception as e:  # e.g. a launch that does not compile here: the others still read
            out[n] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"}
            continue
        out[n] = {"ms": ms, "tflops": round(products * unit / ms / 1e9, 1) if products else None}
    return out


def _combo(rows: dict) -> dict | None:
    """The forward-only change with the fastest forward and the backward-only change with the
    fastest backward (fwd+bwd less fwd), each faster than the shipped config's, together; None
    where either is missing or they touch the same fields."""
    ship = rows.get("inv:shipped", {})
    if "fwdbwd_ms" not in ship:
        return None
    fwd, bwd = {}, {}
    for n, r in rows.items():
        ch = r.get("changes") or {}
        if not n.startswith("inv:") or not r.get("invariant") or not ch or n == "inv:combo":
            continue
        if all(f.startswith("fwd_") for f in ch):
            fwd[n] = r["fwd_ms"]
        elif not any(f.startswith("fwd_") for f in ch) and not ch.get("exp_soft", 0) & 4:  # 4: the forward's exp2
            bwd[n] = r["fwdbwd_ms"] - r["fwd_ms"]
    bf = min(fwd, key=fwd.get, default=None)
    bb = min(bwd, key=bwd.get, default=None)
    if not bf or not bb or fwd[bf] >= ship["fwd_ms"] or bwd[bb] >= ship["fwdbwd_ms"] - ship["fwd_ms"]:
        return None
    return {**rows[bf]["changes"], **rows[bb]["changes"]}


def rows_ok(d: dict) -> bool:
    """Every candidate that ran kept invariance (a config that breaks it is a kernel bug)."""
    return all(r.get("invariant", True) for n, r in d["rows"].items() if n.startswith("inv:"))
