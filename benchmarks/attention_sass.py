"""`python -m benchmarks attention --sass`: the invariant attention kernels compiled for sm_90
WITHOUT a GPU (Triton's bundled ptxas and cuobjdump, as `probes sass` does) - registers, shared
memory, spills, and each innermost loop's instruction mix: what one iteration (one BM x BN block
of (query, key) pairs) issues per thread against the tensor-core work it holds.

Per kernel (the forward, the dq and dk/dv recompute passes, the fused launch; pointer loads - the
TMA variants are other code) at the shipped tiles of D=64 and D=128 and at the candidates named
by --only: for every innermost loop (back-branch target to back-branch) the instructions, HGMMA,
MUFU (exp2), F2FP (packed fp32->bf16 pairs), fp32 FFMA/FMUL/FADD and local-memory spills
(LDL/STL), and three ratios per SM over the tensor-core clocks of the loop's products (at 4096
bf16 FLOP a clock: an H100/H200's dense peak per SM): issue slots (one instruction a clock on each
of 4 schedulers), MUFU lanes (16 a clock: CUDA's throughput table for sm_90), and MUFU + F2FP
lanes (F2FP assumed at the same 16 a clock on the same pipe - not a documented figure). Estimates
from static code, not timings: they say which resource a loop would hit first.
"""
from __future__ import annotations

import collections
import dataclasses
import os
import re
import subprocess
import tempfile

P16, PF = "*bf16", "*fp32"
MMA_FLOP_PER_CLK = 4096  # bf16 dense FLOP a clock per SM (989 TFLOP/s over 132 SMs at 1.83 GHz)
XU_PER_CLK = 16  # MUFU ops a clock per SM (sm_90); F2FP assumed the same, on the same pipe
STRIDES = ("sqb", "sqh", "sqm", "skb", "skh", "skn", "svb", "svh", "svn")


def _compile(k, types: dict, consts: dict, warps: int, stages: int) -> tuple[str, dict]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = k.arg_names
    sig = {n: types.get(n, "constexpr" if n in consts else "i32") for n in names}
    # pointers, strides and lengths 16-divisible, as at the benchmark's shapes
    div = [n for n in names if sig[n].startswith("*") or n in STRIDES + ("sob", "soh", "som", "L", "S")]
    src = ASTSource(fn=k, signature=sig, constexprs={(names.index(n),): v for n, v in consts.items()},
                    attrs={(names.index(n),): [["tt.divisibility", 16]] for n in div})
    c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(c.asm["cubin"])
        f.flush()
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout
        res = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    reg = re.search(r"REG:(\d+)", res)
    return sass, {"registers": int(reg.group(1)) if reg else None, "shared": c.metadata.shared}


def _loops(sass: str) -> list[dict]:
    """Innermost loops in address order: opcode counts between a back-branch's target and it."""
    ins = [(int(a, 16), op.split(".")[0]) for a, op in
           re.findall(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?P\d\s+)?([A-Z0-9_.]+)", sass)]
    spans = [(int(t, 16), int(a, 16)) for a, t in
             re.findall(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?P\d\s+)?BRA\s+0x([0-9a-f]+)", sass) if int(t, 16) < int(a, 16)]
    inner = [s for s in spans if not any(o != s and s[0] <= o[0] and o[1] <= s[1] for o in spans)]
    out = []
    for lo, hi in sorted(inner):
        c = collections.Counter(op for a, op in ins if lo <= a <= hi)
        out.append({"instructions": sum(c.values()), **{o: c.get(o, 0) for o in
                    ("HGMMA", "MUFU", "F2FP", "FFMA", "FMUL", "FADD", "LDL", "STL")}})
    return out


def _kernels(cfg, D: int) -> dict:
    """{pass: (kernel, types, constexprs, warps, stages, BM, BN, products a pair)} of this config."""
    from tpdiag.kernels import attention_triton as at, attention_triton_bwd as atb

    scal = {"qk_scale": "fp32", "sm_scale": "fp32", "LSE": PF, "DELTA": PF}
    out = {"fwd": (at._fwd_kernel, {**{n: P16 for n in "QKVO"}, **scal},
                   dict(CAUSAL=True, BM=cfg.fwd_m, BN=cfg.fwd_n, D=D, PREC="tf32", EVEN=True, TMA=False, I64=False,
                        SOFT=cfg.soft(4), DEG=cfg.exp_soft_deg),
                   cfg.fwd_warps, cfg.fwd_stages, cfg.fwd_m, cfg.fwd_n, 2)}
    if cfg.bwd_fused:
        out["fused"] = (atb._fused_kernel, {**{n: P16 for n in ("Q", "QD", "K", "V", "O", "DO", "DOD", "DQ", "DK", "DV")},
                                            **scal},
                        dict(CAUSAL=True, KV_M=cfg.kv_m, KV_N=cfg.kv_n, Q_M=cfg.q_m, Q_N=cfg.q_n, D=D, PREC="tf32",
                             EVEN_KV=True, EVEN_Q=True, LOADS=False, I64=False, SOFT_KV=cfg.soft(2),
                             SOFT_Q=cfg.soft(1), DEG=cfg.exp_soft_deg),
                        cfg.kv_warps, cfg.kv_stages, None, None, None)
        return out
    if cfg.ds_mib and cfg.ds_every > 1:
        out["dq-mix"] = (atb._dq_mix_kernel, {**{n: P16 for n in ("DS", "Q", "K", "V", "DO", "DQ")}, **scal},
                         dict(CAUSAL=True, BM=cfg.q_m, BN=cfg.q_n, KV_N=cfg.kv_n, EVERY=cfg.ds_every, D=D,
                              PREC="tf32", EVEN=True, I64=False),
                         cfg.q_warps, cfg.q_stages, cfg.q_m, cfg.q_n, 3)
    out["dq"] = (atb._dq_kernel, {**{n: P16 for n in ("Q", "K", "V", "O", "DO", "DQ")}, "CTR": "*i32", **scal},
                 dict(CAUSAL=True, BM=cfg.q_m, BN=cfg.q_n, D=D, PREC="tf32", EVEN=True, I64=False,
                      SOFT=cfg.soft(1), DEG=cfg.exp_soft_deg, LOADS=False, PERSIST=bool(cfg.q_persist)),
                 cfg.q_warps, cfg.q_stages, cfg.q_m, cfg.q_n, 3)
    out["dkdv"] = (atb._dkdv_kernel, {**{n: P16 for n in ("Q", "K", "V", "DO", "DK", "DV", "DS")}, "CTR": "*i32",
                                      **scal},
                   dict(CAUSAL=True, BM=cfg.kv_m, BN=cfg.kv_n, D=D, PREC="tf32", EVEN=True,
                        STORE_DS=1 if cfg.ds_mib else 0, LOADS=False, I64=False,
                        DS_EVERY=max(1, cfg.ds_every) if cfg.ds_mib else 1, SOFT=cfg.soft(2),
                        DEG=cfg.exp_soft_deg, PERSIST=bool(cfg.kv_persist),
                        SPLIT=bool(cfg.kv_split) and not cfg.ds_mib and not cfg.soft(2)),
                   cfg.kv_warps, cfg.kv_stages, cfg.kv_m, cfg.kv_n, 4)
    return out


def _ratios(loop: dict, warps: int, bm: int, bn: int, products: int, D: int) -> dict:
    mma = products * 2 * bm * bn * D / MMA_FLOP_PER_CLK  # tensor-core clocks of one iteration
    issue = loop["instructions"] * warps / 4
    mufu = loop["MUFU"] * warps * 32 / XU_PER_CLK
    xu = (loop["MUFU"] + loop["F2FP"]) * warps * 32 / XU_PER_CLK
    return {"issue_over_mma": round(issue / mma, 2), "mufu_over_mma": round(mufu / mma, 2),
            "mufu_f2fp_over_mma": round(xu / mma, 2)}


def sass(args) -> dict:
    from tpdiag.kernels import attention_triton as at

    from benchmarks.attention_configs import CANDIDATES

    cases = [("D64 shipped", at.config_for(at.torch.bfloat16, 64), 64),
             ("D128 shipped, recompute", dataclasses.replace(at.config_for(at.torch.bfloat16, 128), ds_mib=0), 128),
             ("D128 shipped, stored dS", at.config_for(at.torch.bfloat16, 128), 128)]
    for name, dims, changes in CANDIDATES:
        if args.only and name in args.only.split(","):
            cases += [(f"D{d} {name}", dataclasses.replace(at.config_for(at.torch.bfloat16, d), **changes), d)
                      for d in dims]
    result, lines = {}, []
    for label, cfg, D in cases:
        for p, (k, types, consts, warps, stages, bm, bn, products) in _kernels(cfg, D).items():
            try:
                code, res = _compile(k, types, consts, warps, stages)
            except Exception as e:  # a config past the chip's registers or shared memory
                result[f"{label} / {p}"] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"}
                lines.append(f"{label} / {p}: {result[f'{label} / {p}']['error']}")
                continue
            loops = _loops(code)
            if bm:
                for lp in loops:
                    lp.update(_ratios(lp, warps, bm, bn, products, D))
            all_ops = collections.Counter(op.split(".")[0] for op in re.findall(
                r"/\*[0-9a-f]{4,}\*/\s+(?:@!?P\d\s+)?([A-Z0-9_.]+)", code))
            row = {**res, "spills": all_ops.get("LDL", 0) + all_ops.get("STL", 0), "warps": warps, "loops": loops}
            result[f"{label} / {p}"] = row
            lines.append(f"{label} / {p}: {res['registers']} regs, {res['shared'] // 1024} KiB shared, "
                         f"{row['spills']} LDL/STL in all")
            for i, lp in enumerate(loops):
                lines.append(f"    loop {i}: " + " ".join(f"{x} {y}" for x, y in lp.items()))
            print(lines[-1 - len(loops)], flush=True)
    return {"sass": result, "table": "\n".join(lines)}


def main_sass(args) -> dict:
    """--sass: print the table and write the JSON where asked."""
    from benchmarks.emit import emit

    if os.environ.get("TRITON_INTERPRET") == "1":  # the interpreter compiles nothing
        raise SystemExit("attention --sass compiles for sm_90: run it without TRITON_INTERPRET=1 (and without --smoke)")

    out = sass(args)
    return emit({"sass": out["sass"], "ok": True}, out["table"].splitlines(), args.json)

