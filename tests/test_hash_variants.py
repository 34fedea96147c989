"""A fresh machine's record-hash compiles (issue 59: "no more than ~10 s of kernel compiles"):
the records of a llama-1b compare at TP=1,2 need few compiled variants of the two record-hash
kernels, and the warm-up (runner/warm.py) compiles every one of them before a world meets it.
Counted on the CPU from the records' shapes through record_hash's own launch paths
(`python -m benchmarks hash-variants`, benchmarks/jobs/hash_variants.py); no compile, no GPU.
Before 58bc672 the same records needed 11 variants (5 + 6: each tile shape and EVEN a variant of
its own), one of which (a 512-wide dense shard's) the warm-up's 45 did not hold."""
from __future__ import annotations

import json

from benchmarks.jobs import hash_variants as hv


def _records():
    with open(hv.DEFAULT) as f:
        return [json.loads(line) for line in f if line.strip()]


def test_llama_compare_needs_few_variants_and_the_warmup_has_them():
    run = hv.count(None, _records())
    # per kernel: a layout each (along one slab, dense, strided) and the scalar's
    assert run["by_kernel"] == {"_hash_batch_kernel": 4, "_hash_kernel": 4}, run["keys"]
    cold = [k for k in run["keys"] if not k["warmed"]]
    assert not cold, cold
    # and the warm-up itself is small: each of its compiles is CPU time beside the first worlds
    assert run["warm_variants"] <= 20, run["warm_variants"]


def test_a_records_sizes_pick_no_variant():
    """Ragged or even, wide or narrow, dense shards of any power-of-two width: one compile key per
    (kernel, dtype, layout). The sizes that used to split them: EVEN (a ragged last chunk), the
    tile's rows and columns (a dense shard's width), whole tensors short of a chunk."""
    import torch

    from tpdiag.kernels import record_hash as rh

    def key(kernel, shape, dim=None, full=None, dtype="bfloat16"):
        return hv.compile_keys(rh, kernel, hv._tensor(shape, dtype, 0), dim, full, 0)

    for kernel in ("batch", "one"):
        along = {key(kernel, s) for s in ((1 << 20,), ((1 << 20) + 16,), (4096, 3000), (5, 16384))}
        dense = {key(kernel, (40, w), 1, 2 * w) for w in (16, 64, 256, 512, 1024)} | {key(kernel, (64, 512), 1, 1024)}
        strided = {key(kernel, (40, w), 1, 2 * w) for w in (1408, 2048, 2816, 8000)} | {key(kernel, (2048,))}
        assert len(along) == len(dense) == len(strided) == 1, (kernel, along, dense, strided)
        assert len(along | dense | strided) == 3
    assert torch.bfloat16 in rh._TRITON_T
