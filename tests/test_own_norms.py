"""The own-input pass's reference keeps only what the diff reads of its own float64 re-execution
of a module whose inputs differ at every compared world: [||o||, ||y_ref - o||] (records named
`~norms`, probes/oracle_hooks.py), not o (at llama-1b 1 x 2048 ~2 GB of float64). The verdicts
are those of the whole values (TPDIAG_OWN_NORMS=0, the control); the figures are records like any
other - an edit of one is refused by its stored hash; and a `~norms` record met where the diff
finds the inputs equal (where it would need o whole) judges nothing: unknown, never a verdict."""
import json
import os
import shutil
import sys

import pytest
import torch

from conftest import BEHIND_HASH, ROOT, run_cli
from tpdiag.errors import Inconclusive

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from same_rundirs import _json_lines  # noqa: E402  (timings, hosts and paths dropped)

ARGS = BEHIND_HASH  # behind.py:bugs at TP=1,2, --capture hash, no rerun, no confirmation
VERDICTS = ("summary.json", "diff.csv", "region/summary.json", "region/ops/summary.json", "region/ops/diff.csv")


@pytest.fixture(scope="module")
def pair(tmp_path_factory, behind_hash_run):
    """"1": the default (conftest's session run, read only: edits go to copies); "0":
    TPDIAG_OWN_NORMS=0; "side0": TPDIAG_OWN_SIDE_NORMS=0 (the weight grads re-executed from TP=2's
    inputs whole: tests/test_own_side_norms.py)."""
    out = {"1": behind_hash_run}
    for norms, env in (("0", {"TPDIAG_OWN_NORMS": "0"}), ("side0", {"TPDIAG_OWN_SIDE_NORMS": "0"})):
        d = tmp_path_factory.mktemp(f"norms{norms}") / "r"
        p = run_cli("compare", *ARGS, "--out", str(d), env={"OMP_NUM_THREADS": "1", **env})
        assert p.returncode == 0, p.stderr[-3000:] + p.stdout[-2000:]
        out[norms] = d
    return out


def _events(world):
    with open(world / "events.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


def test_the_verdicts_are_those_of_the_whole_values(pair):
    new, old = pair["1"], pair["0"]
    for name in VERDICTS:
        if name.endswith(".csv"):
            assert (new / name).read_bytes() == (old / name).read_bytes(), name
        else:
            assert _json_lines(str(new / name), str(new)) == _json_lines(str(old / name), str(old)), name
    ref_new, ref_old = new / "region" / "ops" / "tp1", old / "region" / "ops" / "tp1"
    norms = [m for m in _events(ref_new) if m["kind"] == "oracle" and m["name"].endswith("~norms")]
    # the k/v block whose averaged weight grads are the bug, the norm and the head: forward and backward
    assert {(m["phase"], m["module"]) for m in norms} >= {("forward", "kv"), ("backward", "kv"),
                                                          ("forward", "head"), ("backward", "head")}, norms
    # [||o||, ||y - o||, o.o, o.y, y.y, sum o^4, numel] (probes/oracle_hooks.ref_norms)
    assert all(m["local_shape"] == [7] and m["dtype"] == "float64" for m in norms)
    assert not any(m["kind"] == "oracle" and m["name"].endswith("~norms") for m in _events(ref_old))
    whole = {(m["phase"], m["module"]) for m in _events(ref_new) if m["kind"] == "oracle" and "@" not in m["name"]
             and not m["name"].startswith("grad_in.") and not m["name"].endswith("~norms")}
    assert not whole & {(m["phase"], m["module"]) for m in norms}  # no float64 value kept beside its norms
    # the first divergence (the MLP's all-reduce) and the embedding's forward had equal inputs: whole;
    # the embedding's weight grad (its output grad differs) by its norms
    assert {("forward", "mlp"), ("forward", "embed")} <= whole
    assert any(m["name"] == "param_grad.weight~norms" and m["module"] == "embed" for m in norms)
    assert os.path.getsize(ref_new / "records.safetensors") < os.path.getsize(ref_old / "records.safetensors")
    d = json.loads((new / "summary.json").read_text())["degrees"]["2"]
    kv = {f["name"]: f for f in d["findings"] if (f["module"], f["kind"]) == ("kv", "param_grad")}
    assert kv["wv"]["cause"] == "sharding-bug" and kv["wv"]["oracle"]["own"], kv


def _diff(ops):
    from tpdiag.diff import engine, oracle, oracle_own, pair_memo
    from tpdiag.records.store import RecordSet

    pair_memo.clear()
    dd = engine.diff_degree(RecordSet(str(ops / "tp1")), RecordSet(str(ops / "tp2")), "2", keep=lambda m: True)
    oracle.apply(dd)
    oracle_own.apply_own(dd)
    return dd


def test_an_edited_norms_record_is_refused(pair, tmp_path, monkeypatch):
    from safetensors.torch import load_file, save_file

    from tpdiag.records.store import RecordSet

    # the region pass with it: the reference's other records are read from there (records_base)
    shutil.copytree(pair["1"] / "region", tmp_path / "region")
    ops = tmp_path / "region" / "ops"
    assert RecordSet(str(ops / "tp1")).base is not None
    # its number in the reference's own file
    meta = next(m for m in _events(ops / "tp1") if m["key"] == "s0/backward/kv/oracle#0/param_grad.wv~norms")
    target = "s0/backward/kv/param_grad#0/wv"
    before = _diff(ops).rows
    row = next(r for r in before if r["key"] == target)
    assert row["oracle"]["own"] and row["beyond_bound"]
    tensors = load_file(str(ops / "tp1" / "records.safetensors"))
    t = tensors[str(meta["idx"])].clone()
    t[1] = t[0] * 0.5  # the reference as far from its float64 value as the bug: the grad would read rounding
    tensors[str(meta["idx"])] = t
    save_file(tensors, str(ops / "tp1" / "records.safetensors"), metadata={"schema": "1"})
    with pytest.raises(Inconclusive, match="does not match its hash"):
        _diff(ops)
    # negative control: read without its hash check, the edited figure would decide the verdict
    real = RecordSet.tensor
    monkeypatch.setattr(RecordSet, "tensor", lambda self, m, verify=True: real(self, m, verify=False))
    edited = next(r for r in _diff(ops).rows if r["key"] == target)
    assert not edited["beyond_bound"] and edited["oracle"]["ref_err"] != row["oracle"]["ref_err"]


def test_norms_met_with_equal_inputs_judge_nothing(pair):
    """Where the diff reads a module's inputs as equal it judges against o whole (diff/oracle.apply):
    a `~norms` record there contradicts what the reference's world saw - refused, not a verdict."""
    from tpdiag.diff import oracle

    dd = _diff(pair["1"] / "region" / "ops")
    assert dd.oracle_norms
    k = next(k for k in dd.oracle_norms if "/forward/" in k)
    row = next(r for r in dd.rows if r["key"] == k)
    assert row["oracle"]["own"]  # judged on its own inputs from the norms
    for r in dd.rows:  # the module's inputs read as equal
        if (r["step"], r["phase"], r["module"], r["kind"]) == (row["step"], "forward", row["module"], "in"):
            r["bitwise"] = True
    dd._equal_index = None
    row.pop("oracle")
    oracle.apply(dd)
    assert "judge no record of equal inputs" in row["oracle_refused"] and "oracle" not in row


def test_judge_own_from_the_norms_is_judge_own_from_the_values():
    from tpdiag.diff.oracle import judge_own
    from tpdiag.probes.oracle_hooks import ref_norms

    g = torch.Generator().manual_seed(0)
    o_ref = torch.randn(64, 48, generator=g, dtype=torch.float64)
    o_n = o_ref + 1e-3 * torch.randn(64, 48, generator=g, dtype=torch.float64)
    y_ref = (o_ref + 1e-3 * torch.randn(64, 48, generator=g, dtype=torch.float64)).to(torch.float32)
    y_n = o_n.to(torch.float32)
    whole = judge_own(y_ref, y_n, o_ref, o_n)
    assert judge_own(y_ref, y_n, None, o_n, ref_norms=ref_norms(y_ref, o_ref)) == whole
    # of another shape there: the floor, as from the whole value of another shape
    other = judge_own(y_ref, y_n, o_ref[:32], o_n)
    assert judge_own(y_ref, y_n, None, o_n, ref_norms=ref_norms(y_ref[:32], o_ref)) == other
    # negative control: without the figures only the one-rounding floor is left - another threshold
    assert judge_own(y_ref, y_n, None, o_n)["threshold"] != whole["threshold"]


def test_the_norms_are_no_ops_of_the_step(tmp_path):
    """Under an op probe (a decode configuration's second pass records ops and judges on own inputs
    at once) the norms' own vector_norm, sub and stack are not recorded as the reference's ops: each
    was read `missing` at the decode world before they ran with the recorder paused.
    --granularity auto: the second pass records ops whatever the first divergence's verdict (the
    default records them only where it has none: on the AMD hosts this test was written on, decode's
    first divergence needed them; on Intel AVX-512/AMX ones it is wq's rounding, judged at module
    level, and no op probe ran). Where that scope is a leaf GEMM the norms run outside it; the unit
    test below puts them under the probe on every host."""
    d = tmp_path / "r"
    p = run_cli("compare", "--tp", "1", "--mode", "prefill,decode", "--batch-size", "4", "--seq-len", "8",
                "--no-confirm", "--forward-only", "--no-baseline", "--format", "json", "--out", str(d),
                "--granularity", "auto", env={"OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-3000:] + p.stdout[-2000:]
    assert any(m["name"].endswith("~norms") for m in _events(d / "ops" / "tp1"))
    assert any(m["kind"] == "op" for m in _events(d / "ops" / "tp1"))
    ops = json.loads((d / "ops" / "summary.json").read_text())["configurations"]["1-decode"]
    assert ops["missing"] == [], ops["missing"]


@pytest.mark.parametrize("paused", [True, False])
def test_the_norms_under_an_op_probe_record_no_ops(paused, monkeypatch):
    """record_oracle of a module's own-input norms (NAME~norms) inside an op probe's scope: only the
    oracle record, no op of the norms. Negative control: ref_norms called with the recorder
    running (as before 'recorder paused') records its vector_norm, sub and stack as ops."""
    from torch import nn

    from tpdiag.probes import oracle_hooks
    from tpdiag.probes.op_probe import OpProbe
    from tpdiag.probes.recorder import Recorder

    if not paused:
        monkeypatch.setattr(oracle_hooks, "_norms_paused", lambda rec, y, o: oracle_hooks.ref_norms(y, o))
    rec = Recorder(mode="full")
    rec.phase = "forward"
    g = torch.Generator().manual_seed(0)
    mod = nn.Linear(8, 4)
    x = torch.randn(3, 8, generator=g)
    y = mod(x)
    with OpProbe(rec):
        oracle_hooks.record_oracle(rec, mod, "lin", 0, ((x,), {}), None, "Linear", norms_of=y)
    got = [(m["kind"], m["name"]) for m, _ in rec.records]
    assert ("oracle", "0~norms") in got, got
    ops = [n for k, n in got if k == "op"]
    if paused:
        assert ops == [], ops
    else:
        assert {"aten::linalg_vector_norm#0.0", "aten::sub#0.0", "aten::stack#0.0"} <= set(ops), ops


def test_the_sums_tell_a_reference_scaled_from_its_float64_value():
    """A record the reference's world kept as sums only: diff/oracle_own's one-factor rule (a grad
    hook that rescales the reference - tests/test_tp_misc.py scale_tp) reads them as it reads the
    whole float64 value; a reference off its float64 value by rounding noise is no scale."""
    from tpdiag.diff.oracle_own import _scaled_instead
    from tpdiag.probes.oracle_hooks import ref_norms

    g = torch.Generator().manual_seed(0)
    o = torch.randn(64, 48, generator=g, dtype=torch.float64)
    y_ref = (o / 3).to(torch.float32)  # the hook's mark: the reference is its float64 value / S
    y_n = y_ref * 0.5                  # this side rescaled by S * TP
    row_whole, row_sums = {}, {}
    assert _scaled_instead(row_whole, y_ref, y_n, o)
    assert _scaled_instead(row_sums, y_ref, y_n, None, ref_norms(y_ref, o))
    assert row_sums["scale"] == pytest.approx(row_whole["scale"]) == pytest.approx(0.5)
    # control: a reference that is its float64 value plus noise (no factor) - neither path scales
    noisy = (o + 0.2 * torch.randn(64, 48, generator=g, dtype=torch.float64)).to(torch.float32)
    assert not _scaled_instead({}, noisy, noisy * 0.5, o)
    assert not _scaled_instead({}, noisy, noisy * 0.5, None, ref_norms(noisy, o))
    # and records of the older two-figure form never scale (no sums to fit)
    assert not _scaled_instead({}, y_ref, y_n, None, ref_norms(y_ref, o)[:2])


def test_the_verdicts_are_those_of_the_whole_weight_grads(pair):
    """TPDIAG_OWN_SIDE_NORMS=0: the control (tests/test_own_side_norms.py has the figures' own tests)."""
    new, old = pair["1"], pair["side0"]
    for name in VERDICTS:
        if name.endswith(".csv"):
            assert (new / name).read_bytes() == (old / name).read_bytes(), name
        else:
            assert _json_lines(str(new / name), str(new)) == _json_lines(str(old / name), str(old)), name
    ref_new, ref_old = new / "region" / "ops" / "tp1", old / "region" / "ops" / "tp1"
    side = {m["module"]: m for m in _events(ref_new) if m["name"].endswith("~norms@2")}
    # the k/v block's averaged weight grads (the bug), the MLP's, the embedding's and the head's
    assert {"kv", "mlp", "embed", "head"} <= set(side), side
    assert all(m["local_shape"] == [6] and m["dtype"] == "float64" and m["kind"] == "oracle" for m in side.values())
    whole_new = {(m["module"], m["name"]) for m in _events(ref_new) if m["name"].startswith("param_grad.")
                 and m["name"].endswith("@2")}
    whole_old = {(m["module"], m["name"]) for m in _events(ref_old) if m["name"].startswith("param_grad.")
                 and m["name"].endswith("@2")}
    assert not any(n.endswith("~norms@2") for _, n in whole_old)  # the control kept them whole
    assert ("kv", "param_grad.wv.c0@2") in whole_old and ("kv", "param_grad.wv.c0@2") not in whole_new
    # the norm's weight grad: its TP=2 ranks differ (no one value to ship), whole as before
    assert ("norm", "param_grad.weight.c0@2") in whole_new
    assert os.path.getsize(ref_new / "records.safetensors") < os.path.getsize(ref_old / "records.safetensors")
    d = json.loads((new / "summary.json").read_text())["degrees"]["2"]
    kv = {f["name"]: f for f in d["findings"] if (f["module"], f["kind"]) == ("kv", "param_grad")}
    assert kv["wv"]["cause"] == "sharding-bug" and kv["wv"]["oracle"]["own"], kv


TARGET = "s0/backward/kv/param_grad#0/wv"


def test_an_edited_side_norms_record_is_refused(pair, tmp_path, monkeypatch):
    from safetensors.torch import load_file, save_file

    from tpdiag.records.store import RecordSet

    shutil.copytree(pair["1"] / "region", tmp_path / "region")
    ops = tmp_path / "region" / "ops"
    meta = next(m for m in _events(ops / "tp1") if m["key"] == "s0/backward/kv/oracle#0/param_grad.wv~norms@2")
    row = next(r for r in _diff(ops).rows if r["key"] == TARGET)
    assert row["oracle"]["own"] and row["beyond_bound"]
    tensors = load_file(str(ops / "tp1" / "records.safetensors"))
    t = tensors[str(meta["idx"])].clone()
    t[1] = t[0] * 1e-7  # TP=2 as close to its float64 value as rounding: the bug would read rounding
    tensors[str(meta["idx"])] = t
    save_file(tensors, str(ops / "tp1" / "records.safetensors"), metadata={"schema": "1"})
    with pytest.raises(Inconclusive, match="does not match its hash"):
        _diff(ops)
    # negative control: read without its hash check, the edited figure would decide the verdict
    real = RecordSet.tensor
    monkeypatch.setattr(RecordSet, "tensor", lambda self, m, verify=True: real(self, m, verify=False))
    edited = next(r for r in _diff(ops).rows if r["key"] == TARGET)
    assert not edited["beyond_bound"] and edited["oracle"]["err"] < row["oracle"]["err"]


def test_figures_of_another_value_judge_nothing(pair):
    """The figures name the TP=2 record they were taken against by its hash: met beside another
    value (here: the diff's copy of the record changed after its read), no verdict from them."""
    from tpdiag.diff import oracle_own

    dd = _diff(pair["1"] / "region" / "ops")
    assert TARGET in dd.oracle_own_norms and TARGET not in dd.oracle_own
    row = next(r for r in dd.rows if r["key"] == TARGET)
    assert row["oracle"]["own"] and row["beyond_bound"]
    y_ref, y_n = dd.tensors[TARGET]
    y_n = y_n.clone()
    y_n.view(-1)[0] = y_ref.view(-1)[0]  # one element of another value (the bug's half is gone there)
    dd.tensors[TARGET] = (y_ref, y_n)
    for k in ("oracle", "beyond_bound", "bound_ratio", "bound_model"):
        row.pop(k, None)
    oracle_own.apply_own(dd)
    assert "oracle" not in row and "another value than this side's record" in row["oracle_refused"]
