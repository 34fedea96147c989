"""`python -m benchmarks probes sass`: the instruction mix of the record-hash batch kernel's main
loop, compiled for sm_90 WITHOUT a GPU (Triton's bundled ptxas and cuobjdump) - where an element's
time goes when the kernel is issue- or integer-pipe-bound rather than memory-bound
(docs/benchmarks.md, probe cost in hash mode).

Per case (dtype; 16-bit data read one element at a time or as 32-bit word pairs -
kernels/record_hash.py's PAIRS; lane mix version 1 or 2 - record_hash_ref.py's MIXES): instructions
per element in the hashing loop - from the loop's back-branch target to the back-branch (the
loop is unrolled ITERS times; a thread hashes CB * ITERS / (32 * warps) elements a chunk) - and
the opcode counts, and the integer ops per element (IMAD, LOP3, SHF, IADD3, VIADD, PRMT, LEA, ...:
INT_OPS; the fp32 statistics' FFMA/FADD/FMNMX are not counted). Runs on CPU (no device needed).
"""
from __future__ import annotations

import collections
import os
import re
import subprocess
import tempfile

# (label, WIDTH, IS_BF16, PAIRS). (The xorshifts' shifts as inline mul.hi, measured slower and
# removed: docs/benchmarks.md, 2026-11-23, has its counts.)
CASES = (("bf16, element loads", 16, True, False), ("bf16, word pairs (shipped)", 16, True, True),
         ("fp16, element loads", 16, False, False),
         ("fp32", 32, False, False))
# integer-pipe opcodes (SASS mnemonics before the first '.'): what the lane mix spends
INT_OPS = ("IMAD", "LOP3", "SHF", "IADD3", "VIADD", "PRMT", "LEA", "IADD", "ISETP", "SEL", "IABS", "IMNMX",
           "SHL", "SHR", "LOP", "BMSK", "POPC", "FLO", "BREV")


def loop_mix(width: int, bf16: bool, pairs: bool, warps: int | None = None, mix: int | None = None) -> dict:
    """{instructions, per_element, ops: {opcode: count}} of one compiled variant (whole-tensor
    tiles, CB = BLOCK, every chunk full, 16-byte aligned)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from tpdiag.kernels import record_hash as rh

    cb, iters, warps = rh.BLOCK, rh.ITERS, warps or rh.WARPS
    k = rh._triton()._hash_batch_kernel
    consts = {"WIDTH": width, "IS_BF16": bf16, "R": 1, "CB": cb, "ITERS": iters, "ROW_ITERS": False,
              "EVEN": True, "ALIGNED": True, "SLAB16": True, "PAIRS": pairs, "MIX": mix or rh.HASH_VERSION}
    sig = {"table_ptr": "*i64", "ints_ptr": "*i64", "floats_ptr": "*fp64", "NPROG": "i32",
           **{n: "constexpr" for n in consts}}
    src = ASTSource(fn=k, signature=sig, constexprs={(k.arg_names.index(n),): v for n, v in consts.items()},
                    attrs={(i,): [["tt.divisibility", 16]] for i in range(3)})
    c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(c.asm["cubin"])
        f.flush()
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    ins = re.findall(r"/\*([0-9a-f]{4,})\*/\s+(@!?P\d\s+)?([A-Z0-9_.]+)", sass)
    body = None
    for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+@!?P\d\s+BRA\s+0x([0-9a-f]+)", sass):
        at, to = int(m.group(1), 16), int(m.group(2), 16)
        if to < at:  # the first backward branch: the hashing loop's
            body = (to, at)
            break
    sel = [op for a, _, op in ins if body and body[0] <= int(a, 16) <= body[1]]
    per_thread = cb * iters // (32 * warps)
    counts = collections.Counter(op.split(".")[0] for op in sel)
    n_int = sum(c for op, c in counts.items() if op in INT_OPS)
    return {"instructions": len(sel), "elements_per_thread": per_thread,
            "per_element": len(sel) / per_thread, "int_per_element": n_int / per_thread,
            "ops": dict(counts.most_common())}


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
    print("\n".join(lines))
    return {"rows": rows}
