"""--granularity op: the first divergence names the op, also when op sequences differ."""
import json
import os

import pytest
import torch

from conftest import run_cli


def compare(tmp_path, *args):
    p = run_cli("compare", "--out", str(tmp_path / "r"), "--format", "json", "--granularity", "op",
                "--no-baseline", *args)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


@pytest.fixture(scope="module")
def op_pair(tmp_path_factory):
    """ONE stock compare at op granularity, --tp 1,2,2 (the TP=2 world twice: tp2 and tp2-2, each
    its own processes and process group), read by the two tests below. The first divergent op is
    found by pass 1: no own-input judgement past it. (The first test ran a TP=1,4 compare of its
    own: the all-reduce a row-parallel divergence enters through is the same op at any degree.)"""
    out = tmp_path_factory.mktemp("oppair") / "a"
    p = run_cli("compare", "--tp", "1,2,2", "--granularity", "op", "--no-baseline", "--no-confirm",
                "--no-judge-downstream", "--out", str(out), "--format", "json")
    assert p.returncode == 0, p.stderr
    return out, json.loads(p.stdout)


def test_row_parallel_divergence_enters_through_the_all_reduce(op_pair):
    out, s = op_pair
    fd = s["degrees"]["2"]["first_divergence"]
    assert fd["module"] in ("layers.0.attention.wo", "layers.0.feed_forward.w2")
    assert fd["op"] == "_c10d_functional::all_reduce" and "only at this degree" in fd["op_detail"]
    w = json.loads((out / "tp2" / "world.json").read_text())
    assert w["probe_selfcheck"]["equal"]  # the dispatch mode observes only


def test_backward_divergence_is_named_at_op_level(tmp_path):
    """With the forward fixed, the vocab-parallel softmax is what differs: in the loss phase
    where the CPU's kernels show it there - the log-softmax (its logprobs: the exp-sum over two
    vocab halves) or, where those halves' sums round alike (Intel AVX-512/AMX hosts), the loss's
    nll_loss_forward (its token mean: loss_parallel sums each rank's tokens, then all-reduces) -
    and in the backward, where the first divergent op is the loss's nll_loss_backward feeding the
    head's output grad (which comes first depends on the machine's kernels). Whichever it is, the
    named op is the first non-bitwise op record of its phase. The fix's own per-rank partials
    are no replicas: nothing is rank-inconsistent."""
    import csv

    # TP=1,2 (was 1,4): the same first divergence and first backward op there
    s = compare(tmp_path, "--tp", "1,2", "--no-confirm", "--fix", "tp-invariant-linear")
    d = s["degrees"]["2"]
    fd = d["first_divergence"]
    assert fd["cause"] == "vocab-parallel-softmax", fd
    rows = [r for r in csv.DictReader(open(tmp_path / "r" / "diff.csv")) if r["degree"] == "2"]
    if fd["phase"] == "backward":
        assert fd["module"] == "output" and fd["kind"] == "grad_out" and fd["op"] == "aten::nll_loss_backward"
        assert all(r["bitwise"] in ("True", "1") for r in rows if r["phase"] == "loss"), "the loss phase diverged first"
    else:
        # the first op of the loss phase whose bits differ, whichever of the two the host's kernels made it
        loss_ops = sorted((int(r["idx"]), r) for r in rows if r["phase"] == "loss" and r["kind"] == "op"
                          and r["bitwise"] in ("False", "0"))
        assert loss_ops, "the loss phase diverged but no op of it did"
        first_op = loss_ops[0][1]["name"].split("#")[0]
        assert fd["phase"] == "loss" and fd["op"] == first_op, (fd, loss_ops[0])
        if first_op != "aten::_log_softmax":
            # the logprobs were bitwise: the token mean is what the vocab split reordered
            assert (first_op, fd["kind"]) == ("aten::nll_loss_forward", "loss"), fd
            assert all(r["bitwise"] in ("True", "1") for r in rows if r["phase"] == "loss" and r["kind"] == "logprobs")
    back = sorted((int(r["idx"]), r) for r in rows if r["phase"] == "backward" and r["bitwise"] in ("False", "0"))
    assert back, "the backward never diverged"
    assert back[0][1]["kind"] == "op" and back[0][1]["name"].startswith("aten::nll_loss_backward"), back[0]
    assert not [f for f in d["findings"] if f["cause"] == "rank-inconsistent-replica"], d["findings"][:3]


def _cpu_blas_is_shape_dependent() -> bool:
    """narrow.py's k/v GEMM at TP=2: an 8-column shard of its 16 columns."""
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(32, 128, generator=g), torch.randn(16, 128, generator=g)
    return not torch.equal((x @ w.t())[:, :8], x @ w[:8].t())


def test_shape_dependent_gemm_on_cpu_is_found_and_confirmed(tmp_path):
    # TP=1,2 (was 1,8 with 8 kv heads: 8-column shards of 64): narrow.py's 2 kv heads give the
    # same 8-column k/v shards at TP=2, with 1 + 2 ranks a world instead of 1 + 8
    # the first divergent op and its confirmation are what is checked: no own-input judgement past it
    s = compare(tmp_path, "--model", "py:tests/models/narrow.py:target", "--tp", "1,2", "--no-judge-downstream")
    d = s["degrees"]["2"]
    fd = d["first_divergence"]
    if _cpu_blas_is_shape_dependent():
        # 8-column shards of k/v take another BLAS kernel than the full GEMM
        assert fd["module"] in ("layers.0.attention.wk", "layers.0.attention.wv")
        assert fd["op"] == "aten::mm" and fd["cause"] == "shape-dependent-gemm"
        conf = d["confirmation"]
        assert conf["fix"] == "invariant-gemm" and conf["verdict"] == "confirmed"
    else:
        assert fd["cause"] != "shape-dependent-gemm"


def test_auto_records_ops_only_inside_the_first_divergent_module(tmp_path):
    p = run_cli("compare", "--out", str(tmp_path / "r"), "--format", "json", "--granularity", "auto",
                "--no-baseline", "--no-confirm", "--tp", "1,2")  # the ops pass's scope, at any degree
    assert p.returncode == 0, p.stderr
    fd = json.loads(p.stdout)["degrees"]["2"]["first_divergence"]
    assert fd["op"] == "_c10d_functional::all_reduce"
    # pass 1 kept no ops; pass 2 kept only the ops of that one module
    assert '"kind": "op"' not in (tmp_path / "r" / "tp2" / "events.jsonl").read_text()
    ops = [line for line in (tmp_path / "r" / "ops" / "tp2" / "events.jsonl").read_text().splitlines()
           if '"kind": "op"' in line]
    assert 0 < len(ops) < 20 and all(fd["module"] in line for line in ops)
    from test_timing import assert_breakdown

    tb = assert_breakdown(tmp_path / "r")
    (sp,) = [p for p in tb["parts"] if p["part"] == "second-pass"]
    assert sp["what"] == "ops" and set(sp["worlds"]) == {"ops/1", "ops/2"} and sp["s"] > 0
    # the ops pass re-executed the module's ops in float64 in its reference world
    assert tb["totals"]["float64_s"] > 0
    ref = json.loads((tmp_path / "r" / "ops" / "manifest.json").read_text())["worlds"]["1"]["timings"]
    assert ref["float64_s"] > 0


def test_in_place_op_record_holds_its_new_value():
    """The dispatch mode runs before the in-place op's version counter is bumped, so the result
    of `mul_` looks like the unchanged tensor recorded just before: its record must still be the
    new value (on main before this test it was the old one - the clip's `mul_` read as the
    pre-clip grad). The earlier record keeps the old value, so the two records differ."""
    from tpdiag.probes.op_probe import OpProbe
    from tpdiag.probes.recorder import Recorder
    from tpdiag.probes.stream import as_tensor

    rec = Recorder(mode="full")
    rec.phase = "optimizer"
    x = torch.randn(4, 8)
    with OpProbe(rec):
        y = x * 3.0
        y.mul_(2.0)
    recs = {m["name"]: as_tensor(t) for m, t in rec.records}
    assert list(recs) == ["aten::mul#0.0", "aten::mul_#0.0"]
    assert torch.equal(recs["aten::mul_#0.0"], y)
    assert torch.equal(recs["aten::mul#0.0"], x * 3.0) and not torch.equal(recs["aten::mul#0.0"], y)


def test_op_records_of_collectives_are_reproducible(op_pair):
    """The same TP=2 world twice at op granularity: bitwise, collectives included (a functional
    collective's output recorded before its wait changed from run to run); the row-parallel
    all-reduce is still the first divergent op against TP=1. The two TP=2 worlds are one compare's
    (op_pair) - the second compare this ran before added only another TP=1 world."""
    out, s = op_pair
    for label in ("2", "2-2"):
        assert s["degrees"][label]["first_divergence"]["op"] == "_c10d_functional::all_reduce", label
    ev = (out / "tp2" / "events.jsonl").read_text()
    assert ev.count("_c10d_functional::all_reduce") > 10
    p = run_cli("diff", str(out / "tp2"), str(out / "tp2-2"), "--format", "json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["status"] == "bitwise"


def test_module_and_op_granularity_agree_on_the_records_they_share(tmp_path):
    """A hand-written row-parallel layer: its partial sum (an op record at op granularity) is
    all-reduced in place by dist.all_reduce, which bumps no version counter. Before the probes
    forgot what hand-written collectives write (probes/collectives.py), the layer's output was
    recorded as the stale partial at op granularity only: rank_consistent False and max abs
    2.6 there against True and 0.24 at module granularity."""
    import csv

    rows = {}
    for g in ("module", "op"):
        p = run_cli("compare", "--model", "py:" + os.path.join(os.path.dirname(__file__), "models",
                                                       "handwritten.py") + ":row_bias_bug",
                    "--tp", "1,2", "--forward-only", "--no-confirm", "--no-baseline", "--no-judge-downstream",
                    "--granularity", g, "--out", str(tmp_path / g), "--format", "json")  # pass 1's rows
        assert p.returncode == 0, p.stderr
        rows[g] = {r["key"]: r for r in csv.DictReader(open(tmp_path / g / "diff.csv"))
                   if r["kind"] != "op"}
    shared = set(rows["module"]) & set(rows["op"])
    assert any("layers.0/out" in k for k in shared)
    for k in shared:
        a, b = rows["module"][k], rows["op"][k]
        assert (a["rank_consistent"], a["max_abs"], a["bitwise"]) == (b["rank_consistent"], b["max_abs"], b["bitwise"]), k


def test_scoped_op_probe_records_what_the_whole_step_mode_records():
    """OpProbe given the model pushes its dispatch mode only around the included modules' calls
    (a decode world's region pass: every other op of ~1,000 calls skips a Python dispatch). Its
    records - keys, order and bits, module records included - are those of the mode held for the
    whole forward; a scope that includes a child of another included module is entered once."""
    from tpdiag.models.tiny_llama import build
    from tpdiag.probes.module_probe import module_probes
    from tpdiag.probes.op_probe import OpProbe
    from tpdiag.probes.recorder import Recorder
    from tpdiag.probes.stream import as_tensor

    torch.manual_seed(0)
    model = build("tiny-llama")
    ids = torch.randint(0, 64, (2, 8))

    def records(include, scoped):
        rec = Recorder(mode="full")
        rec.phase = "forward"
        with torch.no_grad(), module_probes(model, rec, backward=False), \
                OpProbe(rec, include=include, model=model if scoped else None) as probe:
            model(ids)
            model(ids[:, :5])  # a second call: occurrences go on counting
        assert probe._scoped is None or probe._scoped.depth == 0
        return [(m["key"], as_tensor(t)) for m, t in rec.records]

    for include in ({"layers.0.attention"}, {"layers.1", "layers.1.feed_forward.w2"}):
        whole, scoped = records(include, False), records(include, True)
        ops = [k for k, _ in scoped if "/op#" in k]
        inside = lambda k: any(k.split("/")[2] == m or k.split("/")[2].startswith(m + ".")  # noqa: E731
                               for m in include)
        assert len(ops) > 5 and all(inside(k) for k in ops)
        assert [k for k, _ in whole] == [k for k, _ in scoped]
        assert all(torch.equal(a.view(torch.uint8) if a.is_floating_point() else a,
                               b.view(torch.uint8) if b.is_floating_point() else b)
                   for (_, a), (_, b) in zip(whole, scoped))
    # a phase in the scope (a backward divergence's ops) keeps the mode for the whole step, and
    # so does the root (records name it "model"; an HF model has a child of that name)
    assert OpProbe(Recorder(mode="full"), include={"backward"}, model=model)._scoped is None
    assert OpProbe(Recorder(mode="full"), include={"model"}, model=model)._scoped is None


def test_micro_batch_ops_are_numbered_per_piece_and_never_twice(tmp_path):
    """--granularity op with micro-batches: a piece's ops are numbered as the reference's (per
    piece), and the step's loss after the pieces continues after them - it once restarted at #0
    and the world failed with 'record ... listed twice'."""
    out = tmp_path / "run"
    p = run_cli("compare", "--tp", "1", "--micro-batch", "2,1", "--batch-size", "2", "--seq-len", "8",
                "--granularity", "op", "--no-baseline", "--no-confirm", "--out", str(out), "--format", "json")
    assert p.returncode == 0, p.stderr
    e = json.loads(p.stdout)["configurations"]["1-mb1"]
    assert e["status"] in ("bitwise", "divergent") and not e.get("error"), e
    keys = [json.loads(x)["key"] for x in (out / "tp1-mb1" / "events.jsonl").read_text().splitlines()]
    ops = [k for k in keys if "/op#" in k and "/forward/" in k]
    ref = {json.loads(x)["key"] for x in (out / "tp1" / "events.jsonl").read_text().splitlines()}
    # the forward's ops of both pieces merged under the reference's keys (stock: each op's rows
    # are a slice of the reference's; --fix all's row-blocked GEMMs run other op sequences)
    assert len(ops) > 20 and all(k in ref for k in ops)


def _late_rank_worker(rank, world, port, q):
    """rank 1 joins the all-gather 0.5 s late: rank 0's `c10d::_allgather_base_` returns from
    dispatch with the work still pending, so a record taken then lacks rank 1's half."""
    import time

    import torch
    import torch.distributed as dist

    from tpdiag.probes.op_probe import OpProbe
    from tpdiag.probes.recorder import Recorder
    from tpdiag.probes.stream import as_tensor

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    rec = Recorder(mode="full")
    rec.phase = "optimizer"
    out = torch.zeros(2 * 4)
    if rank == 1:
        time.sleep(0.5)
    with OpProbe(rec):
        # the single-tensor form, as tpdiag's tree kernels call it with the probes in
        dist.all_gather_into_tensor(out, torch.full((4,), float(rank + 1)))
    recs = {m["name"]: as_tensor(t) for m, t in rec.records if m["name"].startswith("c10d::")}
    if rank == 0:
        q.put({k: v.tolist() for k, v in recs.items()} | {"out": out.tolist()})
    dist.destroy_process_group()


def test_an_in_place_collective_is_recorded_after_it_completed():
    """c10d's in-place collectives (what dist.all_gather_into_tensor and kin dispatch) return a
    Work still running on gloo's thread; the op probe waits on it before it copies the output
    (before, the record held rank 0's half and zeros where rank 1's came late)."""
    import warnings

    from conftest import gloo_world

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = gloo_world(_late_rank_worker, 2, timeout=120)
    want = [1.0] * 4 + [2.0] * 4
    assert got["out"] == want, got
    recs = {k: v for k, v in got.items() if k != "out"}
    assert recs and all(v == want for v in recs.values()), got


def test_an_allocation_of_a_strided_buffer_is_no_op_record():
    """autograd's AccumulateGrad clones a grad it cannot steal into `new_empty_strided` + `copy_`
    (torch's clone_obey_contract), and it cannot steal one whose refcount a probe's queued record
    still holds - a race, per rank: a correct model's op-granularity run (ckpt_twice.py:shared_act_ok,
    `compare --granularity op`) recorded `backward/op#0/aten::new_empty_strided` on one rank only and
    failed "ranks recorded different event streams" about one run in three (reviewer hreview13; on
    170f498 as on c8df0f6). An allocation computes no number (its bytes are uninitialised): no record,
    as `empty` and `new_empty` already were not."""
    from tpdiag.probes.op_probe import OpProbe
    from tpdiag.probes.recorder import Recorder

    rec = Recorder(mode="full")
    rec.phase = "backward"
    x = torch.randn(4, 8)
    with OpProbe(rec):
        a = x.new_empty_strided((4, 8), (1, 4))
        a.copy_(x)
        b = torch.empty_strided((4, 8), (8, 1))
        b.copy_(x * 2.0)
    assert [m["name"] for m, _ in rec.records] == ["aten::mul#0.0"], [m["name"] for m, _ in rec.records]
