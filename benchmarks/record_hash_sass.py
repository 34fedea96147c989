"""Instruction mix of the record-hash batch kernel's main loop, compiled for sm_90 WITHOUT a
GPU (Triton's bundled ptxas and cuobjdump): where an element's time goes when the kernel is
issue- or integer-pipe-bound rather than memory-bound (docs/benchmarks.md, record hash, 2026-11-23).

  python benchmarks/record_hash_sass.py            # bf16, whole-tensor tiles (1024 x 8 iters, 4 warps)
  python benchmarks/record_hash_sass.py 32 False   # fp32

Prints instructions per element between the first and the last global load of the loop body's
range (the loop is unrolled ITERS times; each thread hashes CB * ITERS / (32 * warps) elements a
chunk) and the opcode counts.
"""
import collections
import os
import re
import subprocess
import sys


def main(argv):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from tpdiag.kernels import record_hash as rh

    width = int(argv[0]) if argv else 16
    bf16 = (argv[1] == "True") if len(argv) > 1 else width == 16
    cb, iters, warps = 1024, rh.ITERS, rh.WARPS
    rh._triton()
    k = rh._hash_batch_kernel
    consts = {"WIDTH": width, "IS_BF16": bf16, "R": 1, "CB": cb, "ITERS": iters, "ROW_ITERS": False,
              "EVEN": True, "ALIGNED": True, "SLAB16": True}
    sig = {"table_ptr": "*i64", "ints_ptr": "*i64", "floats_ptr": "*fp64", "NPROG": "i32",
           **{n: "constexpr" for n in consts}}
    src = ASTSource(fn=k, signature=sig, constexprs={(k.arg_names.index(n),): v for n, v in consts.items()},
                    attrs={(i,): [["tt.divisibility", 16]] for i in range(3)})
    c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    path = "/tmp/record_hash_sm90.cubin"
    with open(path, "wb") as f:
        f.write(c.asm["cubin"])
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    sass = subprocess.run([tool, "-sass", path], capture_output=True, text=True, check=True).stdout
    ins = re.findall(r"/\*([0-9a-f]{4,})\*/\s+(@!?P\d\s+)?([A-Z0-9_.]+)", sass)
    # the hashing loop: from the loop's back-branch target to the back-branch (first backward BRA)
    addr = [int(a, 16) for a, _, _ in ins]
    body = None
    for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+@!?P\d\s+BRA\s+0x([0-9a-f]+)", sass):
        at, to = int(m.group(1), 16), int(m.group(2), 16)
        if to < at:
            body = (to, at)
            break
    sel = [op for (a, _, op), x in zip(ins, addr) if body and body[0] <= x <= body[1]]
    per_thread = cb * iters // (32 * warps)
    counts = collections.Counter(op.split(".")[0] for op in sel)
    print(f"width {width} bf16 {bf16}: loop body {len(sel)} instructions for {per_thread} elements a thread "
          f"= {len(sel) / per_thread:.1f} per element")
    for op, n in counts.most_common(16):
        print(f"  {op:8s} {n:5d}  {n / per_thread:.2f}/element")


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main(sys.argv[1:])
