"""`python -m benchmarks probes sass`: the instruction mix of the record-hash batch kernel's main
loop, compiled for sm_90 WITHOUT a GPU (Triton's bundled ptxas and cuobjdump) - where an element's
time goes when the kernel is issue- or integer-pipe-bound rather than memory-bound
(`git show d055ef2:docs/benchmarks.md`, "Second round" and "Session 11").

Per case (dtype; 16-bit data read one element at a time or as 32-bit word pairs -
kernels/record_hash.py's PAIRS; lane mix version 1 or 2 - record_hash_ref.py's MIXES): instructions
per element in the hashing loop - from the loop's back-branch target to the back-branch (the
loop is unrolled ITERS times; a thread hashes CB * ITERS / (32 * warps) elements a chunk) - and
the opcode counts, and the integer ops per element (IMAD, LOP3, SHF, IADD3, VIADD, PRMT, LEA, ...:
INT_OPS; the fp32 statistics' FFMA/FADD/FMNMX are not counted). Runs on CPU (no device needed).
"""
from __future__ import annotations

import collections
import contextlib
import os
import re
import subprocess
import tempfile

# (label, WIDTH, IS_BF16, PAIRS). (The xorshifts' shifts as inline mul.hi, measured slower and
# removed: `git show d055ef2:docs/benchmarks.md`, "Second round", has its counts.)
CASES = (("bf16, element loads", 16, True, False), ("bf16, word pairs (shipped)", 16, True, True),
         ("fp16, element loads", 16, False, False),
         ("fp32", 32, False, False))
# integer-pipe opcodes (SASS mnemonics before the first '.'): what the lane mix spends
INT_OPS = ("IMAD", "LOP3", "SHF", "IADD3", "VIADD", "PRMT", "LEA", "IADD", "ISETP", "SEL", "IABS", "IMNMX",
           "SHL", "SHR", "LOP", "BMSK", "POPC", "FLO", "BREV")


def loop_mix(width: int, bf16: bool, pairs: bool, warps: int | None = None, mix: int | None = None,
             slab: int | None = None, regs: int | None = None, iters: int | None = None) -> dict:
    """{instructions, per_element, ops: {opcode: count}, registers, spills} of one compiled
    variant: whole-tensor tiles (CB = BLOCK), or with `slab` the tiles record_hash.plan gives a
    last-dim shard that wide (stacked over rows); every chunk full, 16-byte aligned; `regs`: a
    register cap (maxnreg); `iters`: tiles a chunk (default record_hash.ITERS)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from tpdiag.kernels import record_hash as rh

    warps = warps or rh.WARPS
    iters = iters or rh.ITERS
    row_iters = 0 if slab is None else rh.plan(1 << 20, slab, rh.BLOCK, iters)[2]
    k = rh._triton()._hash_batch_kernel
    consts = {"WIDTH": width, "IS_BF16": bf16, "BLK": rh.BLOCK, "ITERS": iters, "ROW_ITERS": row_iters,
              "ALIGNED": True, "SLAB16": True, "PAIRS": pairs, "MIX": mix or rh.HASH_VERSION}
    if "R" in k.arg_names:  # an older kernel (base_kernel): its tile constexprs and EVEN
        r, cb, _ = (1, rh.BLOCK, 0) if slab is None else _old_plan(slab, iters)
        consts = {"WIDTH": width, "IS_BF16": bf16, "R": r, "CB": cb, "ITERS": iters, "ROW_ITERS": row_iters,
                  "EVEN": True, "ALIGNED": True, "SLAB16": True, "PAIRS": pairs, "MIX": mix or rh.HASH_VERSION}
    sig = {"table_ptr": "*i64", "ints_ptr": "*i64", "floats_ptr": "*fp64", "NPROG": "i32",
           **{n: "constexpr" for n in consts}}
    src = ASTSource(fn=k, signature=sig, constexprs={(k.arg_names.index(n),): v for n, v in consts.items()},
                    attrs={(i,): [["tt.divisibility", 16]] for i in range(3)})
    c = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": warps, **({"maxnreg": regs} if regs else {})})
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(c.asm["cubin"])
        f.flush()
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout
        res = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    reg = re.search(r"REG:(\d+)", res)
    ins = re.findall(r"/\*([0-9a-f]{4,})\*/\s+(@!?P\d\s+)?([A-Z0-9_.]+)", sass)
    # loops: backward branches. The hashing loop (over a program's chunks) is the one with the most
    # global loads (its full chunks' ITERS unrolled tiles); a loop nested in it - a ragged record's
    # masked tiles - does not run for a full chunk, and is left out of the count
    loops = [(int(m.group(2), 16), int(m.group(1), 16))
             for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?P\d\s+)?BRA\s+0x([0-9a-f]+)", sass)
             if int(m.group(2), 16) < int(m.group(1), 16)]
    loads = lambda lo, hi: sum(1 for a, _, op in ins if lo <= int(a, 16) <= hi and op.startswith("LDG"))  # noqa: E731
    body = max(loops, key=lambda lp: (loads(*lp), lp[1] - lp[0]), default=None)
    inner = [lp for lp in loops if body and lp != body and body[0] <= lp[0] and lp[1] <= body[1]]
    sel = [op for a, _, op in ins if body and body[0] <= int(a, 16) <= body[1]
           and not any(lo <= int(a, 16) <= hi for lo, hi in inner)]
    per_thread = rh.BLOCK * iters // (32 * warps)
    counts = collections.Counter(op.split(".")[0] for op in sel)
    n_int = sum(c for op, c in counts.items() if op in INT_OPS)
    registers = int(reg.group(1)) if reg else None
    return {"instructions": len(sel), "elements_per_thread": per_thread,
            "per_element": len(sel) / per_thread, "int_per_element": n_int / per_thread,
            "ops": dict(counts.most_common()), "registers": registers,
            "programs_per_sm": _fit(registers, warps), "spills_in_loop": counts.get("STL", 0) + counts.get("LDL", 0)}


def _fit(registers: int | None, warps: int) -> int | None:
    """Programs of `warps` warps that fit an sm_90 SM's 64K registers at once (a warp's registers
    allocated in units of 256: per thread, rounded up to a multiple of 8)."""
    if not registers:
        return None
    per_warp = -(-registers // 8) * 8 * 32
    return min(32 // warps, 65536 // (per_warp * warps))


# (label, WIDTH, IS_BF16, PAIRS, slab or None): whole tensors and last-dim shards as the shipped
# launch tiles them - the narrow ones stacked over rows, with and without their register cap
LAYOUTS = (("bf16 word pairs, whole", 16, True, True, None), ("bf16 word pairs, 2048 wide", 16, True, True, 2048),
           ("bf16 word pairs, 512 wide", 16, True, True, 512), ("fp32, whole", 32, False, False, None),
           ("fp32, 2048 wide", 32, False, False, 2048), ("fp32, 512 wide", 32, False, False, 512))


def _old_plan(slab: int, iters: int) -> tuple[int, int, int]:
    """(R, CB, ROW_ITERS) the kernels before 58bc672 tiled a last-dim shard `slab` wide with (their
    tile's rows and columns were constexprs; a base kernel of that age takes them)."""
    cb = min(rh_block(), max(16, 1 << (max(slab, 1) - 1).bit_length()))
    return rh_block() // cb, cb, 2 if slab == cb else 1


def rh_block() -> int:
    from tpdiag.kernels import record_hash as rh

    return rh.BLOCK


def sass(args) -> dict:
    rows = []
    for label, width, bf16, pairs in CASES:
        for mix in (1, 2):  # the first lane mix and the shipped one, side by side
            r = loop_mix(width, bf16, pairs, mix=mix)
            rows.append({"case": f"{label}, mix {mix}", "mix": mix, **r})
    top = sorted({op for r in rows for op in list(r["ops"])[:10]},
                 key=lambda op: -max(r["ops"].get(op, 0) for r in rows))
    per = lambda r, op: r["ops"].get(op, 0) / r["elements_per_thread"]  # noqa: E731
    lines = ["record-hash loop, sm_90 SASS compiled without a GPU: instructions per element",
             "| case | per element | integer ops | " + " | ".join(top) + " |", "|---|---|---|" + "---|" * len(top)]
    for r in rows:
        lines.append(f"| {r['case']} | {r['per_element']:.2f} | {r['int_per_element']:.2f} | "
                     + " | ".join(f"{per(r, op):.2f}" for op in top) + " |")
    from tpdiag.kernels import record_hash as rh

    from benchmarks.jobs.probes_util import base_kernel, base_kernel_path

    layouts = []
    base = base_kernel_path()
    variants = [("", contextlib.nullcontext)]  # (label suffix, the kernels it compiles)
    if base:
        variants.append((f", base kernel ({os.path.basename(base)})", lambda: base_kernel(base, launch=False)))
    for tag, ctx in variants:
        with ctx():
            for label, width, bf16, pairs, slab in LAYOUTS:
                for regs in ((None,) if slab is None else (None, rh.NARROW_REGS_DEFAULT)):
                    r = loop_mix(width, bf16, pairs, slab=slab, regs=regs, iters=rh.iters_for(width))
                    row_iters = 0 if slab is None else rh.plan(1 << 20, slab, rh.BLOCK, rh.iters_for(width))[2]
                    shipped = regs == rh.narrow_regs(row_iters, width, pairs)
                    layouts.append({"case": label + tag, "cap": regs, "shipped": shipped, **r})
    lines += ["", "the loop by layout, as the shipped launch tiles it (record_hash.iters_for's chunk; narrow "
              "tiles with and without the register cap they launch with, record_hash.narrow_regs; "
              "programs an SM: by registers, 4 warps each)",
              "| layout | register cap | the launch's | registers | programs an SM | per element | local spills in the loop |",
              "|---|---|---|---|---|---|---|"]
    for r in layouts:
        lines.append(f"| {r['case']} | {r['cap'] or '-'} | {'yes' if r['shipped'] else ''} | {r['registers']} | "
                     f"{r['programs_per_sm']} | {r['per_element']:.2f} | {r['spills_in_loop']} |")
    print("\n".join(lines))
    return {"rows": rows, "layouts": layouts}
