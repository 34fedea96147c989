"""The micro-batch axis: `compare --micro-batch`, real gloo worlds, tiny shapes."""
import csv

import pytest
import torch
from conftest import logprobs_of, run_cli, summary_of

TINY = ("--batch-size", "4", "--seq-len", "8")


_summary, _logprobs = summary_of, logprobs_of


def test_pieces_hash_as_shards_of_the_whole():
    """Hash capture: each micro-batch's slice is hashed at its offset, and the merged record's
    lanes are the whole tensor's, bit for bit (and a reordered batch's are not)."""
    from tpdiag.probes.piece_merge import merge
    from tpdiag.probes.recorder import Recorder, take_lanes

    x = torch.randn(4, 8, 16)
    lanes = []
    for pieces in (1, 4, 2):
        rec = Recorder(mode="hash")
        for k in range(pieces):
            if pieces > 1:
                rec.begin_piece(k, pieces)
            rec.phase = "forward"
            m = 4 // pieces
            rec.add("out", "layer", "0", x[k * m:(k + 1) * m].clone())
        rec.end_pieces()
        merge(rec)
        (meta, _), = rec.records
        assert meta["full_shape"] == [4, 8, 16] and "piece" not in meta
        lanes.append(take_lanes(rec.hashbuf, list(rec.lanes))[0][0, :3].tolist())
    assert lanes[0] == lanes[1] == lanes[2]
    rec = Recorder(mode="hash")
    rec.add("out", "layer", "0", x.flip(0).contiguous())
    assert take_lanes(rec.hashbuf, list(rec.lanes))[0][0, :3].tolist() != lanes[0]


def test_stock_micro_batch_names_batch_variant(mb41_stock_run):
    """(a) stock tiny-llama, TP 1, micro-batch 4 vs 1: gradient accumulation sums the weight
    grads in another order, and the host's CPU GEMM may split 32 rows and 8 differently (MKL on
    one x86 host is batch-invariant at these shapes, on another not at attention.wq): the first
    divergence is a weight grad or a forward GEMM, cause batch-variant-kernel, class rounding;
    where the forward is first, nothing before it differs."""
    out = mb41_stock_run  # conftest's session run: `--tp 1 --micro-batch 4,1` at these TINY shapes
    s = _summary(out)
    assert s["degrees"] == {} and set(s["configurations"]) == {"1-mb1"}
    e = s["configurations"]["1-mb1"]
    assert e["axis"] == "micro_batch" and e["config"] == {"tp": 1, "micro_batch": 1, "mode": "prefill"}
    fd = e["first_divergence"]
    assert fd["cause"] == "batch-variant-kernel" and e["class"] == "rounding"
    assert (fd["phase"], fd["kind"]) in (("backward", "param_grad"), ("loss", "loss"), ("forward", "out"))
    assert (out / "tp1-mb1").is_dir() and (out / "tp1").is_dir()
    rows = list(csv.DictReader(open(out / "diff.csv")))
    if fd["phase"] != "forward":
        # every activation and activation grad of a sequence lines up across the micro-batch sizes
        assert e["logprobs"]["bitwise"] is True
        assert all(r_["bitwise"] == "True" for r_ in rows if r_["kind"] in ("out", "in", "grad_out"))
    else:  # a batch-variant GEMM here: its inputs lined up, and so did every module before it
        assert fd["module"].endswith(("wq", "wk", "wv", "wo", "w1", "w2", "w3", "output")), fd
        firsts = [r_ for r_ in rows if r_["bitwise"] != "True"]
        assert firsts and firsts[0]["module"] == fd["module"], (firsts[:2], fd)


@pytest.fixture(scope="module")
def rowdep_run(tmp_path_factory):
    """ONE run of the row-dependent user module at micro-batch 4 vs 1: test (b)'s, and test (c)'s
    negative control (its logprobs)."""
    out = tmp_path_factory.mktemp("rowdep") / "run"
    r = run_cli("compare", "--model", "py:tests/models/rowdep.py:target", "--tp", "1", "--micro-batch", "4,1",
                *TINY, "--no-baseline", "--out", str(out), "--format", "json", "--fail-on-divergence")
    return out, r


def test_user_row_dependent_module_is_rounding_not_bug(rowdep_run):
    """(b) a user module whose reduction splits by the call's row count is the first divergence,
    batch-variant-kernel, rounding - the float64 oracle agrees it is not a bug."""
    out, r = rowdep_run
    assert r.returncode == 1, r.stderr  # divergent, not a bug (4)
    e = _summary(out)["configurations"]["1-mb1"]
    fd = e["first_divergence"]
    assert (fd["phase"], fd["module"]) == ("forward", "norm"), fd
    assert fd["cause"] == "batch-variant-kernel" and e["class"] == "rounding"
    assert e["logprobs"]["bitwise"] is False
    rows = {r_["key"]: r_ for r_ in csv.DictReader(open(out / "diff.csv"))}
    assert rows["s0/forward/norm/in#0/0"]["bitwise"] == "True"


def test_fix_all_logprobs_bitwise_across_micro_batches(rowdep_run, mb41_fixall_run):
    """(c) --fix all: the forward's logprobs are the same bits at micro-batch 4 and 1 (torch.equal);
    the negative control: a batch-variant user module's are not, so the check can fail."""
    # conftest's session run (the whole step, which test_micro_batch_carry reads too): its
    # forward records are those of a forward-only run
    fixed, (control, rc) = mb41_fixall_run, rowdep_run
    assert torch.equal(_logprobs(fixed, "1"), _logprobs(fixed, "1-mb1"))
    e = _summary(fixed)["configurations"]["1-mb1"]
    # every forward record is bitwise; the step's loss is the micro-batches' shares added (another
    # summation order than one mean), so it may differ in its last bit
    rows = list(csv.DictReader(open(fixed / "diff.csv")))
    assert all(r_["bitwise"] == "True" for r_ in rows if r_["kind"] != "loss")
    assert e["status"] == "bitwise" or e["first_divergence"]["kind"] == "loss"
    # the control: the row-dependent module's run (the same forward, its step and confirmation too)
    assert rc.returncode == 1, rc.stderr
    a, b = _logprobs(control, "1"), _logprobs(control, "1-mb1")
    assert a.shape == b.shape and not torch.equal(a, b)


@pytest.mark.parametrize("grid", [False, True])
def test_tp_and_micro_batch_axes(grid):
    """(d) --tp 1,2 --micro-batch 4,2: one axis at a time, or every combination with --grid."""
    from tpdiag.base.points import worlds
    from tpdiag.config import degree_labels

    ws = worlds((1, 2), (4, 2), ("prefill",), grid, degree_labels)
    got = [(w.label, w.point.tp, w.point.micro_batch, w.axis) for w in ws]
    want = [("1", 1, 4, ""), ("2", 2, 4, "tp"), ("1-mb2", 1, 2, "micro_batch")]
    if grid:
        want.append(("2-mb2", 2, 2, "tp+micro_batch"))
    assert got == want


@pytest.fixture(scope="module")
def stock_grid(tmp_path_factory):
    """ONE stock grid run, full capture, the whole step: test_grid_run reads it, and it is the
    full-capture control of test_hash_capture_of_micro_batches_at_tp_2. Neither reads a verdict on
    the modules past the first divergence: no own-input judgement (a second pass of every world)."""
    out = tmp_path_factory.mktemp("grid") / "run"
    r = run_cli("compare", "--tp", "1,2", "--micro-batch", "4,2", "--grid", *TINY, "--capture", "full",
                "--no-confirm", "--no-baseline", "--no-judge-downstream", "--out", str(out), "--format", "json")
    assert r.returncode == 0, r.stderr
    return out


def test_grid_run(stock_grid, tmp_path):
    out = stock_grid
    s = _summary(out)
    assert set(s["degrees"]) == {"2"} and set(s["configurations"]) == {"1-mb2", "2-mb2"}
    assert s["configurations"]["2-mb2"]["axis"] == "tp+micro_batch"
    assert s["degrees"]["2"]["axis"] == "tp"
    # (f) the load() frames and the gate carry the axis
    import tpdiag

    run = tpdiag.load(str(out))
    assert dict(zip(run.degrees["degree"], run.degrees["axis"])) == {
        "2": "tp", "1-mb2": "micro_batch", "2-mb2": "tp+micro_batch"}
    assert set(run.records["axis"]) == {"tp", "micro_batch", "tp+micro_batch"}
    g = run_cli("gate", str(out))
    assert g.returncode in (0, 1), g.stderr
    assert "TP=1 mb=2" in g.stdout + g.stderr  # the configuration, named as compare names it
    rep = run_cli("report", str(out), "-o", str(tmp_path / "r.html"))
    assert rep.returncode == 0, rep.stderr
    assert "1-mb2" in (tmp_path / "r.html").read_text()


def test_micro_batch_must_divide_the_batch(tmp_path):
    """(e) one line, exit 2, no world started."""
    out = tmp_path / "run"
    r = run_cli("compare", "--tp", "1", "--micro-batch", "4,3", *TINY, "--out", str(out))
    assert r.returncode == 2
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "--micro-batch 3" in lines[0] and "--batch-size 4" in lines[0], r.stderr
    assert not (out / "tp1").exists()
    # decode with micro-batches is refused before any world (tests/test_decode_compare.py: the rest)
    r = run_cli("compare", "--tp", "1", "--micro-batch", "4,2", *TINY, "--mode", "prefill,decode",
                "--forward-only", "--out", str(out))
    assert r.returncode == 2 and "--mode decode with --micro-batch" in r.stderr, r.stderr
    assert not (out / "tp1").exists()


def test_hash_capture_of_micro_batches_at_tp_2(stock_grid, tmp_path):
    """Hash capture with micro-batches at TP=2 (what a large model gets): a piece's column shard
    is hashed at two offsets (batch rows, the rank's columns), a sharded weight's accumulated grad
    at its TP offset only. Under --fix all every configuration is bitwise through the hashes -
    a misplaced offset would sum to other lanes (tests/test_axes_capture.py) - and stock is
    divergent at the row-parallel reduction, as under full capture."""
    import json

    def run(name, *extra, capture="hash"):
        out = tmp_path / name
        # first divergences and hashes are compared, as in stock_grid: no own-input judgement past them
        r = run_cli("compare", "--tp", "1,2", "--micro-batch", "4,2", "--grid", *TINY, *extra, "--capture",
                    capture, "--no-confirm", "--no-baseline", "--no-judge-downstream", "--out", str(out),
                    "--format", "json")
        assert r.returncode == 0, r.stderr
        return out, _summary(out)

    out, s = run("fix", "--fix", "all")
    assert s["status"] == "bitwise" and s["capture"] == "hash", {
        k: v.get("first_divergence") for k, v in s["configurations"].items()}
    events = [json.loads(x) for x in (out / "tp2-mb2" / "events.jsonl").read_text().splitlines()]
    hashed = lambda kind: [e for e in events if e.get("stored") == "hash" and e["kind"] == kind  # noqa: E731
                           and (e.get("hash_layout") or "").startswith("shard:")]
    assert len(hashed("out")) > 5 and len(hashed("param_grad")) > 5
    # the negative control: stock, the same hashes, divergent where full capture is - at TP=2 a
    # row-parallel reduction (which of the two first depends on the host's CPU GEMM)
    def firsts(out_s):
        return {k: (v["first_divergence"] or {}).get("key") for k, v in out_s[1]["configurations"].items()}
    hashed_firsts, full_firsts = firsts(run("stock")), firsts((stock_grid, _summary(stock_grid)))
    assert hashed_firsts == full_firsts and all(hashed_firsts.values()), (hashed_firsts, full_firsts)
    assert hashed_firsts["2-mb2"] in ("s0/forward/layers.0.attention.wo/out#0/0",
                                      "s0/forward/layers.0.feed_forward.w2/out#0/0"), hashed_firsts


@pytest.mark.parametrize("mode", ["hash", "full"])
def test_a_per_call_value_is_one_record_only_if_every_piece_agrees(mode):
    """A record that is not a slice of the batch (its shape is the whole's: a per-call value such
    as a router's expert counts) is kept once when every micro-batch gave the same bits, and
    per piece (`.pieceN`, unmatched at the reference) when they differ - in hash capture too, where
    piece 0's lanes used to stand for all of them unchecked."""
    from tpdiag.probes.piece_merge import merge
    from tpdiag.probes.recorder import Recorder

    def merged(values):
        ref = Recorder(mode=mode)
        ref.phase = "forward"
        ref.add("out", "router", "0", values[0].clone())
        (meta, _), = ref.records
        rec = Recorder(mode=mode, piece_ref={meta["key"]: [16]})
        for k, v in enumerate(values):
            rec.begin_piece(k, len(values))
            rec.phase = "forward"
            rec.add("out", "router", "0", v.clone())
        rec.end_pieces()
        merge(rec)
        return [m["key"] for m, _ in rec.records]

    same = torch.arange(16.0)
    assert merged([same, same]) == ["s0/forward/router/out#0/0"]
    keys = merged([same, same.flip(0)])
    assert keys == ["s0/forward/router/out#0/0.piece0", "s0/forward/router/out#0/0.piece1"], keys


def test_micro_batch_is_checked_before_the_model_is_built(tmp_path, monkeypatch):
    # a new user's `compare --model hf:DIR --micro-batch 4,1` (the default --batch-size is 2) waited
    # ~20 s on a busy 2-core machine - transformers imported, the model built on the meta device
    # for the plan check - before its one-line error: the axes need no model and come first
    from tpdiag.config import CompareConfig
    from tpdiag.errors import BadInput
    from tpdiag.models import precheck
    from tpdiag.runner.compare import validate

    def built(*a, **k):
        raise AssertionError("the model was built before the micro-batch check")

    monkeypatch.setattr(precheck, "check_plan", built)
    (tmp_path / "config.json").write_text('{"model_type": "llama", "vocab_size": 64}')
    cfg = CompareConfig.of(model=f"hf:{tmp_path}", degrees=(1, 2), micro_batches=(4, 1), batch_size=2)
    with pytest.raises(BadInput, match="--micro-batch 4: must divide --batch-size 2"):
        validate(cfg)
