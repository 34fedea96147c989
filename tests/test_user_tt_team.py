"""A torchtitan-style team's own model, `parallelize` (sequence parallelism through a DTensor plan,
loss_parallel, output tied to the embedding) and 3-step AdamW loop with clipping, step 0 recorded by
`tpdiag.capture` in gloo worlds (tests/user_tt_team.py, helper hcap19), then `tpdiag diff` / `gate`.

- the capture changes no bit of the loop (loss, logits, grads, grad norms, final parameters) at
  TP=1 and at TP=2; TP=1 and TP=2 themselves differ (the comparison can fail);
- the correct plan reads rounding only; clipping by the local shards' norm reads BUG at the grad
  norm (rank-inconsistent-replica), gate 4;
- an output tied before the plan (two weights at TP=2) reads BUG (sharding-bug) at the tied weight's
  grad, naming the split tie, gate 4: main at 3c46cde refused it (exit 2, the lost tie named);
- the attention left without its sequence-parallel input layout (each rank attends over its own
  positions) reads BUG (sharding-bug) at layers.0.attention.wq's output, the first record the ranks
  hold only part of, every record after it not compared, gate 4: main at 3c46cde refused it (exit 2,
  "the ranks hold 256 of its 512 elements");
- clipping by the local shards' norm with `cap.grad_norm` NOT recorded reads BUG at the parameters after
  the step (each rank's shard of the consumed grad scaled by a factor of its own), gate 4: main at
  cc6fdab read it "rounding only", gate 0 with --allow rounding (norm.weight 2 lr off), as nothing
  bounded the user's own optimizer step (diff/optim_step.py);
- either verdict edited out of summary.json is inconclusive at the gate (exit 2), never a pass.
`tpdiag compare` on the same mistakes: tests/test_tt_sp_compare.py."""
import csv
import json

import pytest
import torch

from conftest import run_cli
from user_worlds import capture_worlds

WORLDS = ((1, "none"), (1, "none:nocap"), (2, "none"), (2, "none:nocap"),
          (2, "clip_local"), (2, "clip_local:nonorm"), (2, "tie_before"), (2, "sp_noprep"))


@pytest.fixture(scope="module")
def captures(tmp_path_factory):
    return capture_worlds(tmp_path_factory.mktemp("ttteam"), "user_tt_team", "step", WORLDS)


def _load(path):
    return torch.load(path, weights_only=False)


def _equal(a, b) -> bool:
    if isinstance(a, dict):
        return set(a) == set(b) and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return torch.equal(a, b)


def test_capture_changes_no_bit_of_the_loop(captures):
    for n in (1, 2):
        cap, plain = _load(captures / f"{n}-none.dump.pt"), _load(captures / f"{n}-none:nocap.dump.pt")
        assert len(cap["loss"]) == 3 and _equal(cap, plain), n
    # the same check fails where the numbers differ: TP=1 against TP=2 (rounding)
    assert not _equal(_load(captures / "1-none.dump.pt"), _load(captures / "2-none.dump.pt"))


def _diff(captures, tmp_path, other):
    out = tmp_path / other
    p = run_cli("diff", str(captures / "1-none"), str(captures / other), "--out", str(out))
    return p, out


def test_correct_plan_is_rounding_only(captures, tmp_path):
    p, out = _diff(captures, tmp_path, "2-none")
    assert p.returncode == 0, p.stdout + p.stderr
    s = json.loads((out / "summary.json").read_text())
    assert s["class"] == "rounding" and not s["degrees"]["2"]["findings"], s["degrees"]["2"]
    assert "BUG" not in p.stdout
    assert run_cli("gate", str(out), "--allow", "rounding").returncode == 0
    # what its AdamW consumed was recorded, and every parameter it moved apart judged by a re-run of it
    steps = json.loads((captures / "2-none" / "world.json").read_text())["optimizer_steps"]
    assert [e["class"] for e in steps] == ["torch.optim.adamw.AdamW"], steps
    rows = [r for r in csv.DictReader((out / "diff.csv").open()) if r["kind"] == "param"]
    assert any(r["bitwise"] == "False" for r in rows), rows


def test_clip_by_local_shards_without_the_norm_reads_bug_at_the_params(captures, tmp_path):
    from tpdiag.diff.classes import leading_bug

    p, out = _diff(captures, tmp_path, "2-clip_local:nonorm")
    assert p.returncode == 0, p.stdout + p.stderr
    s = json.loads((out / "summary.json").read_text())
    e = s["degrees"]["2"]
    lead = leading_bug(e)
    assert s["class"] == "bug" and lead is not None, e["findings"]
    assert (lead["phase"], lead["kind"], lead["cause"]) == ("optimizer", "param", "sharding-bug"), lead
    assert "each rank scaled its shard of the grad the optimizer consumed by a factor of its own" in lead["why"], lead
    # every other parameter it moved is grouped under it, none passed: the SequenceParallel norm's (its
    # consumed grad a Partial whose ranks' shares were scaled apart: no multiple of the recorded grad)
    # is not judged, never rounding
    norm = next(f for f in e["findings"] if (f["module"], f["kind"]) == ("norm", "param"))
    assert norm["cause"] == "unknown" and norm["follows"] == lead["key"], norm
    assert "not the recorded grad times one factor" in norm["why"], norm
    assert "BUG" in p.stdout and _gate(out) == 4

    def drop(s, e):
        _as_rounding(s, e)
        e["findings"] = [f for f in e["findings"] if not f.get("optimizer_step")]

    assert _edited(out, tmp_path, "drop_opt", drop) == 2


def test_clip_by_local_shards_reads_bug_at_the_grad_norm(captures, tmp_path):
    p, out = _diff(captures, tmp_path, "2-clip_local")
    assert p.returncode == 0, p.stdout + p.stderr
    s = json.loads((out / "summary.json").read_text())
    f = s["degrees"]["2"]["findings"][0]
    assert s["class"] == "bug" and (f["phase"], f["cause"]) == ("optimizer", "rank-inconsistent-replica"), f
    assert "grad_norm" in f["kind"] + f["name"], f
    assert run_cli("gate", str(out), "--allow", "rounding").returncode == 4


def _gate(out) -> int:
    return run_cli("gate", str(out), "--allow", "rounding").returncode


def _edited(out, tmp_path, name, edit) -> int:
    """The gate's exit code on a copy of diff `out` whose summary.json `edit` changed."""
    import shutil

    copy = tmp_path / name
    shutil.copytree(out, copy)
    s = json.loads((copy / "summary.json").read_text())
    edit(s, s["degrees"]["2"])
    (copy / "summary.json").write_text(json.dumps(s))
    return _gate(copy)


def _as_rounding(s, e):
    s["class"] = e["class"] = "rounding"


def test_tie_split_by_the_plan_reads_bug_at_the_tied_grad(captures, tmp_path):
    m = json.loads((captures / "1-none" / "manifest.json").read_text())
    assert m["model"]["fingerprint"]["tied"] == {"output.weight": "tok_embeddings.weight"}
    p, out = _diff(captures, tmp_path, "2-tie_before")
    assert p.returncode == 0, p.stdout + p.stderr
    s = json.loads((out / "summary.json").read_text())
    e = s["degrees"]["2"]
    assert s["class"] == "bug" and e["ties_split"] == [["tok_embeddings.weight", "output.weight"]], e
    f = next(f for f in e["findings"] if f.get("split_tie"))
    assert (f["cause"], f["kind"], f["module"], f["name"]) == ("sharding-bug", "param_grad", "tok_embeddings", "weight"), f
    assert "split the weight tie tok_embeddings.weight = output.weight" in f["detail"], f
    assert "tie them after the plan" in f["detail"] and "output.weight" in p.stdout, p.stdout
    # the forward before it compares as rounding: the two weights start equal
    assert e["first_divergence"]["phase"] == "forward" and e["first_divergence"]["cause"] != "sharding-bug"
    assert _gate(out) == 4

    def drop(s, e):
        _as_rounding(s, e)
        e["findings"] = [g for g in e["findings"] if not g.get("split_tie")]

    def drop_both(s, e):
        drop(s, e)
        del e["ties_split"]

    assert _edited(out, tmp_path, "drop", drop) == 2
    assert _edited(out, tmp_path, "drop_both", drop_both) == 2


def test_attention_on_local_positions_reads_bug_at_wq(captures, tmp_path):
    p, out = _diff(captures, tmp_path, "2-sp_noprep")
    assert p.returncode == 0, p.stdout + p.stderr
    s = json.loads((out / "summary.json").read_text())
    e = s["degrees"]["2"]
    key = "s0/forward/layers.0.attention.wq/out#0/0"
    fd = e["first_divergence"]
    assert s["class"] == "bug" and (fd["key"], fd["cause"]) == (key, "sharding-bug"), fd
    assert "the 2 ranks hold 256 of its 512 elements together" in fd["why"] and "input_layouts" in fd["why"], fd
    assert [f["key"] for f in e["findings"]] == [key] and e["findings"][0]["cause"] == "sharding-bug", e["findings"]
    # every record before it gathered bitwise equal: its inputs were the reference's
    rows = [r for r in csv.DictReader((out / "diff.csv").open())]
    assert rows and all(r["bitwise"] == "True" for r in rows), [r["key"] for r in rows if r["bitwise"] != "True"]
    assert any(r["key"] == "s0/forward/layers.0.attention.wq/in#0/0" for r in rows)
    # nothing after it is compared, so nothing after it reads rounding
    n = e["shape_break"]["not_compared_after"]
    assert e["shape_break"]["key"] == key and n > 50, e["shape_break"]
    assert e["not_compared"]["why"]["past the first record the ranks hold only part of"] == n, e["not_compared"]
    assert not any(r["phase"] == "backward" for r in rows)
    assert _gate(out) == 4

    def drop(s, e):
        _as_rounding(s, e)
        e["findings"], e["first_divergence"] = [], None

    def drop_both(s, e):
        drop(s, e)
        del e["shape_break"]

    def relabel(s, e):
        _as_rounding(s, e)
        for f in e["findings"] + [e["first_divergence"]]:
            f["cause"] = "row-parallel-reduction"
            f.pop("why", None)

    for name, edit in (("drop", drop), ("drop_both", drop_both), ("relabel", relabel)):
        assert _edited(out, tmp_path, name, edit) == 2, name
