"""kernels/interpreter_patch.py: under the Triton interpreter a launch patches triton.language once,
not again at every jit helper call, and the kernel's results are the same bits either way."""
import pytest
from conftest import interpreter_result

SCRIPT = r"""
import json

import torch
import triton.runtime.interpreter as ti

if not all(hasattr(ti, n) for n in ("_patch_lang", "_LangPatchScope", "GridExecutor")):
    # another Triton release: lighten() installs nothing there (kernels/interpreter_patch.py)
    print("RESULT " + json.dumps({"skip": "this Triton's interpreter has not the internals the patch replaces"}))
    raise SystemExit(0)
calls = [0]
orig, grid = ti._patch_lang, ti.GridExecutor.__call__


def counted(fn):
    calls[0] += 1
    return orig(fn)


ti._patch_lang = counted  # Triton's own patching, counted; lighten() wraps it on import
from tpdiag.kernels import record_hash as rh

rh._triton()
assert ti._patch_lang is not counted and ti.GridExecutor.__call__ is not grid  # installed
torch.manual_seed(0)
full = torch.randn(4, 8, 1024).to(torch.bfloat16)  # 8 tiles: helper calls enough to count
p = full.chunk(4, dim=0)[1].contiguous()
args = rh.slab(p.shape, 0, 4, 1)


def launch():
    calls[0] = 0
    ints, _ = rh.triton_lanes(p, *args)
    ints[:2] &= rh.M32
    return ints.tolist(), calls[0]


want, _ = rh.lanes_torch(p, *args)
want[:2] &= rh.M32
fast, n_fast = launch()
again, n_again = launch()
ti._patch_lang, ti.GridExecutor.__call__ = counted, grid  # undone: a patch at every helper call
slow, n_slow = launch()
print("RESULT " + json.dumps({"want": want.tolist(), "fast": fast, "again": again, "slow": slow,
                              "n": [n_fast, n_again, n_slow]}))
"""


def test_a_launch_patches_the_language_once_and_computes_the_same_bits():
    r = interpreter_result(SCRIPT)
    if "skip" in r:
        pytest.skip(r["skip"])
    n_fast, n_again, n_slow = r["n"]
    assert r["fast"] == r["again"] == r["slow"] == r["want"], r
    # once a launch for each set of language modules its functions see (the kernel's and its
    # helpers' `tl`; triton.language.standard's `core`, whose reductions it calls): 2-3; Triton's
    # own code patched again at each helper call (201 on Triton 3.9)
    assert max(n_fast, n_again) <= 3 and n_slow > 20 * max(n_fast, n_again), r["n"]
