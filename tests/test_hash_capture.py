"""Hash-first capture (`--capture hash`): shard lanes add up to the whole tensor's, the Triton
kernel and the torch path agree bit for bit, a hash run finds what a full run finds, and the
recorder keeps no tensor (so no device memory, no host copy, no autograd graph) in hash mode."""
import json
import os
import subprocess
import sys
import weakref

import pytest
import torch

from conftest import ROOT, run_cli
from tpdiag.kernels import record_hash as rh


def _lanes_of_shards(full, dim, n):
    tot = torch.zeros(2, dtype=torch.int64)
    off = 0
    for part in full.chunk(n, dim=dim):
        ints, _ = rh.lanes_torch(part.contiguous(), *rh.slab(part.shape, dim, full.shape[dim], off))
        tot[:2] += ints[:2]
        off += part.shape[dim]
    return int(tot[0]) & rh.M32, int(tot[1]) & rh.M32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64,
                                   torch.float64, torch.bool])
def test_shard_lanes_add_up_to_the_whole_tensor(dtype):
    full = (torch.randn(4, 6, 8) * 5).to(dtype)
    want = rh.reference_lanes(full)  # plain-Python definition
    ints, _ = rh.lanes_torch(full, *rh.slab(full.shape, None, None, 0))
    assert (int(ints[0]), int(ints[1])) == want
    for dim in range(3):
        for n in (2, 4):
            assert _lanes_of_shards(full, dim, n) == want, (dim, n)


def test_lanes_see_one_bit_and_a_swap():
    full = torch.randn(64, 32)
    base = rh.reference_lanes(full)
    flipped = full.clone()
    flipped.view(torch.int32)[3, 5] ^= 1
    swapped = full.clone()
    swapped[[0, 1]] = swapped[[1, 0]]
    assert rh.reference_lanes(flipped)[0] != base[0]  # one element: lane a always changes
    assert rh.reference_lanes(swapped) != base
    # a shard placed at the wrong offset is another tensor
    part = full[:32]
    ints, _ = rh.lanes_torch(part, *rh.slab(part.shape, 0, 64, 32))
    ints2, _ = rh.lanes_torch(part, *rh.slab(part.shape, 0, 64, 0))
    assert not torch.equal(ints, ints2)


def test_triton_kernel_matches_the_torch_path_bit_for_bit():
    """The CUDA kernel, through the Triton interpreter (a subprocess: the interpreter flag must
    be set before Triton is imported)."""
    code = r"""
import torch
from tpdiag.kernels import record_hash as rh
rh._triton()
torch.manual_seed(0)
paths = set()
# [3, 8, 1100]: slabs longer than a block, masked tails, narrow [R, CB] tiles for last-dim
# shards; [2, 8, 1024]: every chunk full (no masks), also for its 512- and 16-wide shards. Each
# dtype and shard dim gets the launch plans [3, 10, 1100] and [4, 8, 1024] gave, at 0.8 and 0.5 of
# their elements (uneven dim-0 shards kept: 3 rows)
for shape, ways in (((3, 8, 1100), 2), ((2, 8, 1024), 2), ((4, 8, 64), 4)):
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        full = torch.randn(*shape).to(dt)
        full[0, 0, 0] = float("nan"); full[1, 2, 3] = float("inf")
        for dim in (None, 0, 1, 2):
            parts = [full] if dim is None else list(full.chunk(ways, dim=dim))
            off = 0
            for p in parts:
                p = p.contiguous()
                args = rh.slab(p.shape, dim, None if dim is None else full.shape[dim], off)
                pl = rh.plan(args[0], args[1] * args[2])
                paths.add(pl[:3] + pl[5:])
                ia, fa = rh.lanes_torch(p, *args)
                ib, fb = rh.triton_lanes(p, *args)
                # another launch shape, into row 2 of a buffer chunk: the same lanes
                slot = (torch.zeros(3, 4, dtype=torch.int64), torch.zeros(3, 2, dtype=torch.float64), 2)
                rh.triton_lanes(p, *args, out=slot, block=256, iters=2, waves=1)
                ic = slot[0][2].clone()
                for i in (ia, ib, ic):
                    i[:2] &= rh.M32
                assert torch.equal(ia, ib), (dt, dim, ia, ib)  # lanes, non-finite count, max |x|
                assert torch.equal(ia, ic), (dt, dim, ia, ic)
                assert not slot[0][:2].any()
                assert torch.allclose(fa, fb, rtol=1e-5), (dt, dim, fa, fb)
                off += 0 if dim is None else p.shape[dim]
# both kernel paths (masked / EVEN) and 1-D and narrow tiles were exercised
assert {p[3] for p in paths} == {True, False} and len({p[:2] for p in paths}) >= 4, paths
# finite values whose fp32 square overflows: the kernel's fast statistics see an infinite sum
# and re-read the chunks testing each element - counted finite, max |x| exact
for dt, big in ((torch.float32, 1e30), (torch.bfloat16, 3e38), (torch.float16, 6e4)):
    t = torch.randn(4, 8, 1024).to(dt)
    t[1, 2, 3] = big
    t[3, 7, 1000] = -big
    args = rh.slab(t.shape, None, None, 0)
    ia, _ = rh.lanes_torch(t, *args)
    ib, _ = rh.triton_lanes(t, *args)
    ia[:2] &= rh.M32
    ib[:2] &= rh.M32
    assert torch.equal(ia, ib) and int(ib[2]) == 0, (dt, ia, ib)
# program counts against the chunk grid: a program's chunks are stepped without a division
# (chunk -> row group, column group carried by NPROG = dq * N_COL + dr), with 1..13 programs over
# 1 to several column groups, narrow [R, CB] tiles with R > 1 and word pairs. Each row's tensor
# is the smallest whose launches keep the tiles (R, CB, ROW_ITERS, EVEN, word pairs), program
# count, step (dq, dr), a program's several chunks and wrap / no wrap between column groups that
# [6, 40, 300] and [5, 3000] gave (a quarter of the interpreted tiles): [1, 10, 260] / [6, 9, 260]
# (its 130-wide shard) for the [6, 40, 300] rows, [1538] / [5, 2664] for the whole [5, 3000]
SMALL, WIDE = ((64, 3, 1), (64, 3, 2), (16, 2, 3)), ((128, 2, 13),)
steps = set()
for shape, dim, ways, dt, launches in (((1, 10, 260), 2, 2, torch.bfloat16, SMALL),
                                       ((6, 9, 260), 2, 2, torch.bfloat16, WIDE),
                                       ((1538,), None, 1, torch.bfloat16, SMALL),
                                       ((5, 2664), None, 1, torch.bfloat16, WIDE),
                                       ((9, 70), 1, 2, torch.float32, SMALL + WIDE),
                                       ((7, 2, 130), 2, 1, torch.float16, SMALL + WIDE),
                                       # dense tiles of several slabs (record_hash.plan's layout 2:
                                       # a power-of-two shard, R = block / 32 > 1), word pairs
                                       ((12, 64), 1, 2, torch.bfloat16, SMALL + WIDE)):
    full = torch.randn(*shape).to(dt)
    p = full if dim is None else full.chunk(ways, dim=dim)[-1].contiguous()
    args = rh.slab(p.shape, dim, None if dim is None else shape[dim], 0 if dim is None else shape[dim] - p.shape[dim])
    ia, _ = rh.lanes_torch(p, *args)
    ia[:2] &= rh.M32
    for block, iters, waves in launches:
        pl = rh.plan(args[0], args[1] * args[2], block, iters)
        nprog = min(pl[3] * pl[4], waves * 4)  # _sm_count is 4 off CUDA
        steps.add((nprog // pl[4] > 0, nprog % pl[4] > 0, pl[0] > 1))
        # word pairs are bf16's only: for another dtype pairs=True is the same launch as False
        for pairs in (False, True) if dt == torch.bfloat16 else (False,):
            ib, _ = rh.triton_lanes(p, *args, block=block, iters=iters, waves=waves, pairs=pairs)
            ib[:2] &= rh.M32
            assert torch.equal(ia, ib), (shape, dim, dt, block, iters, waves, pairs, ia, ib)
# steps of whole row groups only, of column groups only, of both; tiles of several rows
assert {s[:2] for s in steps} == {(True, False), (False, True), (True, True)} and any(s[2] for s in steps), steps
print("ok")
"""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT)
    # ~150 s of interpreted launches on a 2-core machine; beside the other xdist worker it ran past 300
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=900)
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), p.stderr[-3000:]


def test_hash_mode_keeps_no_tensor_and_no_graph():
    from tpdiag.config import WorldConfig
    from tpdiag.probes.recorder import KEEP_WHOLE, Recorder
    from tpdiag.runner import step

    cfg = WorldConfig.of(model="tiny-llama", degree=1, label="1", out_dir="", capture="hash")
    rec = Recorder()
    seen = []
    orig = rec.add

    def add(kind, module, name, t, **kw):
        if kind == "out" and isinstance(t, torch.Tensor):
            seen.append(weakref.ref(t))
        return orig(kind, module, name, t, **kw)

    rec.add = add
    step.run(cfg, torch.device("cpu"), 1, rec)
    kept = [m["kind"] for m, t in rec.records if t is not None]
    assert rec.mode == "hash" and len(rec.records) > 100
    assert set(kept) <= set(KEEP_WHOLE), set(kept)
    assert all(t is None for m, t in rec.records if m["kind"] in ("out", "param", "grad_out"))
    # the activations the probes saw are gone: nothing of the recorder holds them or their graph
    assert seen and all(r() is None for r in seen)


@pytest.fixture(scope="module")
def hash_run(tmp_path_factory):
    """ONE stock hash compare at TP=1,2,4,8 (its region pass included), read by the two tests
    below: (run directory, the summary it printed)."""
    out = tmp_path_factory.mktemp("hash") / "h"
    # the first divergence's values are what is compared here; the own-input pass after a hash
    # pass (tests/test_behind.py) would double this run's time at TP=1,2,4,8
    p = run_cli("compare", "--tp", "1,2,4,8", "--capture", "hash", "--out", str(out), "--no-confirm",
                "--no-baseline", "--no-judge-downstream", "--format", "json")
    assert p.returncode == 0, p.stderr
    return out, json.loads(p.stdout)


def test_hash_run_finds_what_the_full_run_finds(stock_run, hash_run):
    out, h = hash_run
    full = json.loads((stock_run / "summary.json").read_text())
    assert h["capture"] == "hash" and full["capture"] == "full"
    ev = [json.loads(x) for x in (out / "tp2" / "events.jsonl").read_text().splitlines()]
    assert sum(m["stored"] == "hash" for m in ev) > 100
    # every record compared in both runs has the same bitwise verdict (both kinds occur)
    import csv

    def verdicts(d):
        with open(d / "diff.csv") as f:
            return {(r["degree"], r["key"]): r["bitwise"] for r in csv.DictReader(f)}

    vh, vf = verdicts(out), verdicts(stock_run)
    both = set(vh) & set(vf)
    assert len(both) > 400
    assert {vh[k] for k in both} == {"True", "False"}
    assert [k for k in both if vh[k] != vf[k]] == []
    for label in ("2", "4", "8"):
        a, b = h["degrees"][label], full["degrees"][label]
        assert a["status"] == b["status"] == "divergent"
        fa, fb = a["first_divergence"], b["first_divergence"]
        # the region pass measured the located record with whole tensors
        for k in ("key", "module", "cause", "max_abs", "max_ulp", "mismatch_fraction", "bound"):
            assert fa[k] == fb[k], (label, k, fa[k], fb[k])
        assert fa["values_run_dir"].endswith("region")
        assert a["logprobs"] == b["logprobs"]
    # the second pass's own worlds (reference + divergent degrees) and their per-phase split
    sp = h["timings"]["second_pass_worlds"]
    assert set(sp) == {"1", "2", "4", "8"} and all(w["steps_s"] > 0 for w in sp.values())
    assert h["timings"]["phases"]["second_pass_s"] > 0
    # the full run's second pass (if any: its own-input judgement) is timed the same way
    assert ("second_pass_worlds" in full["timings"]) == bool(full.get("second_pass"))
    assert h["timings"]["second_pass_phases"]["diff_s"] > 0


def test_hash_mode_names_a_rank_inconsistent_replica(tmp_path):
    # the first divergence's verdict is what is checked (the region pass's): no own-input pass after it
    p = run_cli("compare", "--model", "py:tests/models/rank_noise.py:target", "--tp", "1,2",
                "--fix", "tp-invariant-linear",  # the planted noise first, whatever the CPU's sums
                "--capture", "hash", "--no-baseline", "--no-confirm", "--no-judge-downstream",
                "--out", str(tmp_path / "r"), "--format", "json")
    assert p.returncode == 0, p.stderr
    fd = json.loads(p.stdout)["degrees"]["2"]["first_divergence"]
    assert fd["module"] == "layers.0.ffn_norm" and fd["cause"] == "rank-inconsistent-replica", fd


def test_fix_all_is_bitwise_in_hash_mode(tmp_path):
    """The negative control is the stock hash run above (divergent at every degree). TP=1,2: that
    hash mode's verdicts at TP=4 and 8 are the full run's, bitwise rows included, is
    test_hash_run_finds_what_the_full_run_finds; that --fix all is bitwise at TP=4 and 8 is
    test_fixes.py's test_fix_all_is_bitwise_at_every_degree."""
    p = run_cli("compare", "--tp", "1,2", "--capture", "hash", "--fix", "all", "--no-baseline",
                "--out", str(tmp_path / "r"), "--format", "json")
    assert p.returncode == 0, p.stderr
    s = json.loads(p.stdout)
    assert s["status"] == "bitwise" and s["capture"] == "hash", s


def test_hash_mode_still_finds_a_sharding_bug_behind_a_reordering(tmp_path):
    """The planted bug of tests/models/buggy.py (layer 1's row-parallel output rescaled), behind
    a harmless layer-0 reordering: the hash pass only sees that layer 1's w2 output moved far
    more than its input; the region pass bound-checks it with whole tensors."""
    p = run_cli("compare", "--model", "py:tests/models/buggy.py:target", "--tp", "1,2",
                "--capture", "hash", "--no-baseline", "--no-confirm", "--out", str(tmp_path / "r"),
                "--format", "json")
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)["degrees"]["2"]
    assert d["first_divergence"]["cause"] == "row-parallel-reduction"
    assert d["first_divergence"]["module"].startswith("layers.0.")
    assert "layers.1.feed_forward.w2" in d["suspects"]
    # root findings (the model's own output "follows" w2's)
    bugs = [f for f in d["findings"] if f["cause"] == "sharding-bug" and "follows" not in f]
    assert [f["module"] for f in bugs] == ["layers.1.feed_forward.w2"], d["findings"]
    assert bugs[0]["bound_ratio"] > 10 and bugs[0]["from"] == "second pass"


def test_region_pass_proves_its_step_by_fingerprint(hash_run, tmp_path):
    """The region pass runs no unprobed step: each of its worlds must compute the step pass 1
    computed at its degree (same fingerprint). A probe that changes the numerics only under
    full capture - only in the region pass - is caught there, and its values are not used."""
    def run(env):
        out = tmp_path / ("bad" + str(len(list(tmp_path.iterdir()))))
        # the region pass is what is checked, as in hash_run: no own-input pass after it
        p = run_cli("compare", "--tp", "1,2", "--capture", "hash", "--no-baseline", "--no-confirm",
                    "--no-judge-downstream", "--out", str(out), "--format", "json", env=env)
        assert p.returncode == 0, p.stderr
        return out, json.loads(p.stdout)["degrees"]["2"]["first_divergence"]

    # the good run: the stock hash run (TP=1,2,4,8); its TP=1 and TP=2 worlds, as the controls'
    out, fd = hash_run[0], hash_run[1]["degrees"]["2"]["first_divergence"]
    assert fd["max_ulp"] is not None and fd["values_run_dir"].endswith("region") and "values_detail" not in fd
    for label in ("1", "2"):
        first = json.loads((out / f"tp{label}" / "world.json").read_text())
        region = json.loads((out / "region" / f"tp{label}" / "world.json").read_text())
        assert region["probe_selfcheck"] is None and first["probe_selfcheck"]["equal"] is True
        assert len(first["fingerprint"]) == int(label) and region["fingerprint"] == first["fingerprint"]
    # negative controls: a probe that perturbs the located module's output in full mode (the
    # region probes that module) - in every world (the region's reference fails the check), and
    # in the TP=2 world only (the reference passes, TP=2 fails)
    module = fd["module"]
    for where, who in (("", "TP=1 rank 0:"), ("@2", "TP=2 rank ")):
        out, fd = run({"TPDIAG_TEST_PERTURB_PROBE": f"full:{module}{where}"})
        assert f"computed another step than the first pass ({who}" in fd["values_detail"], fd
        assert fd.get("max_ulp") is None and "values_run_dir" not in fd
