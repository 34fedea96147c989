"""The mode axis: `compare --mode prefill,decode`, real gloo worlds, tiny shapes.

A decode world runs the prompt in one call and then one token per call through the built-in
KV cache; its records are placed as positions of the prefill reference's (runner/decode.py,
probes/pieces.py), so the diff's first divergence is the first op whose inputs were equal."""

import json

import pytest
import torch
from conftest import logprobs_of, run_cli, summary_of

TINY = ("--batch-size", "2", "--seq-len", "8", "--forward-only")


_summary, _logprobs = summary_of, logprobs_of


def _bits(t):
    return t.contiguous().view(torch.int32)


def test_decode_calls_are_placed_as_positions_of_the_reference():
    """A decode call's record is the slice [start, stop) of the reference's along the dim the
    reference's shape says (a module's [B, S, D]: dim 1; a [S, D] table: dim 0); merged, hash
    lanes equal the whole tensor's and full capture is the whole tensor, bit for bit; a
    reordered sequence's lanes do not."""
    from tpdiag.probes.piece_merge import merge
    from tpdiag.probes.recorder import Recorder, take_lanes

    x, table = torch.randn(2, 8, 4), torch.randn(8, 3)
    spans = [(0, 4)] + [(t, t + 1) for t in range(4, 8)]
    ref = {"s0/forward/layer/out#0/0": [2, 8, 4], "s0/forward/rope/out#0/0": [8, 3]}

    def run(mode, x, table, pieces=True):
        rec = Recorder(mode=mode, piece_ref=ref)
        for k, (a, b) in enumerate(spans if pieces else [(0, 8)]):
            if pieces:
                rec.begin_piece(k, len(spans), (a, b, 8))
            rec.phase = "forward"
            rec.add("out", "layer", "0", x[:, a:b].clone())
            rec.add("out", "rope", "0", table[a:b].clone())
        rec.end_pieces()
        merge(rec)
        return rec

    whole = run("hash", x, table, pieces=False)
    want = take_lanes(whole.hashbuf, list(whole.lanes))[0][:, :3].tolist()
    rec = run("hash", x, table)
    assert [m["full_shape"] for m, _ in rec.records] == [[2, 8, 4], [8, 3]]
    assert take_lanes(rec.hashbuf, list(rec.lanes))[0][:, :3].tolist() == want
    flipped = run("hash", x.flip(1).contiguous(), table)
    assert take_lanes(flipped.hashbuf, list(flipped.lanes))[0][0, :3].tolist() != want[0]
    full = run("full", x, table)
    from tpdiag.probes.stream import as_tensor

    got = [as_tensor(t) for _, t in full.records]
    assert torch.equal(got[0].view(torch.int32), x.view(torch.int32))
    assert torch.equal(got[1].view(torch.int32), table.view(torch.int32))


def test_stock_decode_is_batch_variant_and_the_fixes_remove_it(tmp_path):
    """Stock: decode's first divergence is a GEMM whose inputs were bitwise equal (one position
    per call: M = B rows instead of B * S), rounding, and the batch-invariant fixes confirm it;
    its logprobs differ from prefill's (the negative control of the test below)."""
    out = tmp_path / "run"
    r = run_cli("compare", "--tp", "1", "--mode", "prefill,decode", *TINY, "--no-baseline",
                "--out", str(out), "--format", "json")
    assert r.returncode == 0, r.stderr
    d = _summary(out)["configurations"]["1-decode"]
    assert d["axis"] == "mode" and d["config"]["mode"] == "decode"
    fd = d["first_divergence"]
    assert fd["phase"] == "forward" and fd["cause"] == "batch-variant-kernel", fd
    assert _summary(out)["class"] == "rounding"
    assert d["confirmation"]["verdict"] == "confirmed", d["confirmation"]
    assert not torch.equal(_bits(_logprobs(out, "1")), _bits(_logprobs(out, "1-decode")))
    # every reference record has its decode counterpart (the calls' pieces placed and merged)
    assert d["n_records"] > 0 and not d.get("missing"), d.get("missing")


def test_fix_all_makes_decode_prefill_bitwise_at_tp_1_and_2(tmp_path):
    """Hash capture (what a large model gets): at TP=2 a decode call's column-parallel output is a
    slice along two dims - its positions and its rank's columns - hashed with both offsets; the
    pieces' and ranks' lanes add up to TP=1 prefill's (tests/test_axes_capture.py: a wrong
    offset gives other lanes)."""
    import json

    out = tmp_path / "run"
    r = run_cli("compare", "--tp", "1,2", "--mode", "prefill,decode", "--grid", "--fix", "all", *TINY,
                "--capture", "hash", "--no-baseline", "--no-confirm", "--out", str(out), "--format", "json")
    assert r.returncode == 0, r.stderr
    s = _summary(out)
    assert s["status"] == "bitwise", {k: v.get("first_divergence") for k, v in s["configurations"].items()}
    assert set(s["configurations"]) == {"1-decode", "2-decode"}
    ref = _logprobs(out, "1")
    for lab in ("2", "1-decode", "2-decode"):
        assert torch.equal(_bits(ref), _bits(_logprobs(out, lab))), lab
    events = [json.loads(x) for x in (out / "tp2-decode" / "events.jsonl").read_text().splitlines()]
    two_d = [e for e in events if e.get("stored") == "hash" and e.get("hash_layout") == "shard:2"
             and e["kind"] == "out"]
    assert len(two_d) > 5 and all(e.get("full_hash") for e in two_d)


def test_hf_decode_through_transformers_cache_is_prefill_bitwise_under_fix_all(tmp_path):
    """An hf: model decodes through transformers' DynamicCache; its modules' records line up
    with prefill's (nothing unmatched), and --fix all makes every one bitwise."""
    import pytest

    pytest.importorskip("transformers", minversion="5")
    from hf_configs import write_tiny

    spec = write_tiny("llama", tmp_path / "m")
    out = tmp_path / "run"
    r = run_cli("compare", "--model", spec, "--tp", "1", "--mode", "prefill,decode", "--fix", "all", *TINY,
                "--no-baseline", "--no-confirm", "--out", str(out), "--format", "json")
    assert r.returncode == 0, r.stderr
    d = _summary(out)["configurations"]["1-decode"]
    assert d["status"] == "bitwise" and not d["unmatched"] and not d["missing"], d
    assert torch.equal(_bits(_logprobs(out, "1")), _bits(_logprobs(out, "1-decode")))


def test_decode_without_forward_only_runs_decode_forward_only_and_says_so(tmp_path):
    """--backward (the default) with a decode configuration: the TP=2 world runs the whole step,
    the decode world forward only (decode has no backward); nothing of the reference's backward
    counts as missing from it, and the `ran:` line says which worlds ran forward only."""
    import json

    out = tmp_path / "run"
    # what each world ran and recorded (pass 1): no own-input judgement past the first divergence
    r = run_cli("compare", "--tp", "1,2", "--mode", "prefill,decode", "--batch-size", "2", "--seq-len", "8",
                "--no-baseline", "--no-confirm", "--no-judge-downstream", "--out", str(out))
    assert r.returncode == 0, r.stderr
    ran = next(x for x in r.stdout.splitlines() if x.startswith("ran:"))
    assert ran == ("ran: 1 step at each degree (forward, backward and optimizer step); 1-decode: forward "
                   "only (decode has no backward)"), ran
    phases = {lab: {json.loads(x)["phase"] for x in (out / f"tp{lab}" / "events.jsonl").read_text().splitlines()}
              for lab in ("2", "1-decode")}
    assert {"backward", "optimizer"} <= phases["2"], phases
    assert not {"backward", "optimizer"} & phases["1-decode"], phases
    s = _summary(out)
    assert not s["configurations"]["1-decode"]["missing"] and not s["degrees"]["2"]["missing"]


def test_decode_bad_input_is_one_line_and_starts_no_world(tmp_path):
    for args, words in (
            (("--mode", "decode,prefill", *TINY), "list prefill first"),
            (("--mode", "prefill,decode", "--micro-batch", "2,1", *TINY), "not supported yet"),
            (("--mode", "prefill,replay", *TINY), "expected one of prefill, decode"),
            # a one-token call cannot be split along the sequence over two ranks
            (("--tp", "1,2", "--grid", "--variant", "sp", "--mode", "prefill,decode", *TINY),
             "decode configuration 2-decode would shard a one-token call")):
        out = tmp_path / "x"
        r = run_cli("compare", *(() if "--tp" in args else ("--tp", "1")), *args, "--out", str(out))
        assert r.returncode == 2, (args, r.stdout, r.stderr)
        err = r.stderr.strip().splitlines()
        assert len(err) == 1 and words in err[0], (args, err)
        assert not (out / "tp1").exists()


@pytest.mark.parametrize("batch,capture", [("1", "auto"), ("2", "hash")])
def test_decode_ops_line_up_with_prefills(tmp_path, batch, capture):
    """--granularity op on a decode world: a call's n-th op of a module is the slice of prefill's
    n-th (occurrences count per call, as call indices do), so every recorded op of the reference
    has its decode counterpart and the first divergence names the op - at batch 2 too, where a
    linear's mm sees the B sequences' rows of the call flat ([B, N] against prefill's [B * S, N]),
    under hash capture. What grew call by call (the KV cache's concatenation, the scores over the
    keys so far) is never the reference's: kept for the first call only, the rest counted (a
    region pass on llama-1b 1 x 2048 captured 6.7 GB of it)."""
    out = tmp_path / "run"
    r = run_cli("compare", "--tp", "1", "--mode", "prefill,decode", "--forward-only", "--batch-size", batch,
                "--seq-len", "16", "--granularity", "op", "--capture", capture, "--no-baseline", "--no-confirm",
                "--out", str(out), "--format", "json")
    assert r.returncode == 0, r.stderr
    d = _summary(out)["configurations"]["1-decode"]
    fd = d["first_divergence"]
    assert fd["cause"] == "batch-variant-kernel" and fd.get("op", "").startswith("aten::"), fd
    # unmatched: only the decode world's own concatenations (the KV cache grown per call, its
    # logits assembled), each the first call's
    assert not d.get("missing") and all("aten::cat#" in k for k in d["unmatched"]), d["unmatched"]
    ref_ops = [json.loads(x)["key"] for x in (out / "tp1" / "events.jsonl").read_text().splitlines()
               if json.loads(x)["kind"] == "op"]
    dec = {json.loads(x)["key"] for x in (out / "tp1-decode" / "events.jsonl").read_text().splitlines()}
    assert len(ref_ops) > 50 and all(k in dec for k in ref_ops)
    world = json.loads((out / "tp1-decode" / "world.json").read_text())
    assert world["timings"]["piece_records_left_out"] > 0


def test_decode_self_check_runs_a_prefix_and_catches_noisy_decode_steps(tmp_path):
    """A decode world's unprobed self-check runs the prompt call and the first 16 one-token
    calls (not all of them) and compares their logits bit for bit with the probed run's: at
    seq 48 (prompt 24) positions 0..39. Negative control: a model whose one-token calls add
    run-to-run noise fails it, and the configuration is `failed`, not a finding."""
    args = ("--tp", "1", "--mode", "prefill,decode", "--batch-size", "1", "--seq-len", "48",
            "--forward-only", "--no-confirm", "--no-baseline", "--format", "json")
    good, bad = tmp_path / "good", tmp_path / "bad"
    r = run_cli("compare", *args, "--out", str(good))
    assert r.returncode == 0, r.stderr
    sc = json.loads((good / "tp1-decode" / "world.json").read_text())["probe_selfcheck"]
    assert {k: v for k, v in sc.items() if k != "logits_hash"} == {
        "equal": True, "checked": 1, "first_mismatch": None, "positions": 40}, sc
    assert len(sc["logits_hash"]) >= 16, sc
    r = run_cli("compare", "--model", "py:tests/models/noisy_decode.py:target", *args, "--out", str(bad))
    sc = json.loads((bad / "tp1-decode" / "world.json").read_text())["probe_selfcheck"]
    assert sc["equal"] is False and sc["first_mismatch"] == "logits of positions 0..39", sc
    d = _summary(bad)["configurations"]["1-decode"]
    assert d["status"] == "failed" and "probed and the unprobed run" in d["error"], d


@pytest.mark.parametrize("mode", ["full", "hash"])
def test_flat_rows_of_b_sequences_merge_into_prefills_tensor(mode):
    """A decode call's flat [B * n, N] record (a linear's mm at batch B) is each sequence's rows
    at its own positions: the calls' pieces merge into exactly prefill's [B * L, N] - the tensor
    under full capture, its lanes under hash capture - and calls merged in the wrong order do
    not (the negative control)."""
    from tpdiag.probes.piece_merge import merge
    from tpdiag.probes.recorder import Recorder, take_lanes

    B, L, P, N = 2, 6, 3, 5
    whole = torch.randn(B, L, N)
    flat = whole.reshape(B * L, N)

    def merged(spans, rows_of=None):
        rec = Recorder(mode=mode, piece_ref={"s0/forward/lin/out#0/0": [B * L, N]})
        for k, (a, b) in enumerate(spans):
            rec.begin_piece(k, len(spans), (a, b, L))
            rec.phase = "forward"
            a, b = (rows_of or spans)[k]
            rec.add("out", "lin", "0", whole[:, a:b].reshape(B * (b - a), N).clone())
        rec.end_pieces()
        merge(rec)
        (meta, t), = rec.records
        assert meta["key"] == "s0/forward/lin/out#0/0"
        return t if mode == "full" else take_lanes(rec.hashbuf, list(rec.lanes))[0][0, :3].tolist()

    spans = [(0, P)] + [(t, t + 1) for t in range(P, L)]
    got = merged(spans)
    if mode == "full":
        assert torch.equal(got, flat)
    else:
        ref = Recorder(mode="hash")
        ref.add("out", "lin", "0", flat.clone())
        assert got == take_lanes(ref.hashbuf, list(ref.lanes))[0][0, :3].tolist()
    # two calls' rows filed at each other's positions: not prefill's
    bad = merged(spans, [(0, P), (P + 1, P + 2), (P, P + 1)] + spans[3:])
    if mode == "full":
        assert not torch.equal(bad, flat)
    else:
        assert bad != got
