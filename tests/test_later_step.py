"""Mistakes that act only from the second training step on, in bfloat16 (tests/models/planted/
later_step.py, --tp 1,2 --steps 3): from step 1 on each degree's weights are its own AdamW update's, so
the row-parallel MLP's per-rank partial sums add up to this side's sum, never the reference's. Main at
00909fb read `shares that do not add up` there as a `sharding-bug`: BUG at step 1 for the correct twins
(fast_sum, maxnorm_whole) as for the bugs, gate 4 for all four. Now the shares of a step whose weights
differ are left uncompared (diff/partials.updated_steps) and the module's output is judged on this side's
own inputs: the twins read rounding only (gate 0 with --allow rounding), the bugs stay BUG (gate 4)."""
import json

import pytest

from conftest import run_cli, shared_run


def _run(tmp_path_factory, case):
    def make(out):
        p = run_cli("compare", "--model", f"py:tests/models/planted/later_step.py:{case}", "--tp", "1,2",
                    "--steps", "3", "--dtype", "bfloat16", "--no-confirm", "--no-baseline", "--out", str(out),
                    env={"OMP_NUM_THREADS": "1"})
        assert p.returncode == 0, p.stderr[-3000:] + p.stdout[-2000:]
    out = shared_run(tmp_path_factory, f"later-step-{case}", make)
    g = run_cli("gate", str(out), "--allow", "rounding")
    return json.loads((out / "summary.json").read_text()), g.returncode, g.stdout + g.stderr


@pytest.mark.parametrize("case", ["fast_sum", "maxnorm_whole"])
def test_a_correct_twin_is_rounding_at_every_step(tmp_path_factory, case):
    s, gate, out = _run(tmp_path_factory, case)
    d = s["degrees"]["2"]
    assert s["class"] == "rounding" and d["class"] == "rounding", (s["class"], d.get("findings"))
    assert gate == 0, out
    # the later steps' shares are said not compared (summary.json's reason is their kind's)
    left = set((d.get("not_compared") or {}).get("module_records") or ())
    assert {f"s{k}/forward/mlp.reduce/in#0/0" for k in range(3)} <= left, d.get("not_compared")


@pytest.mark.parametrize("case", ["fast_mean", "maxnorm_shard"])
def test_a_later_step_mistake_is_a_bug_at_its_step(tmp_path_factory, case):
    s, gate, out = _run(tmp_path_factory, case)
    d = s["degrees"]["2"]
    assert s["class"] == "bug", s["class"]
    assert gate == 4, out
    bugs = [f for f in [d["first_divergence"], *d.get("findings", ())] if f.get("cause") == "sharding-bug"]
    # nothing at step 0 (the mistake acts from the second step), found at step 1
    assert bugs and min(f["step"] for f in bugs) == 1, bugs
    # judged by a float64 re-execution, not by the shares' sum (left uncompared at that step)
    assert all("shares do not add up" not in (f.get("why") or "") for f in bugs), bugs
    assert any((f.get("oracle") or {}).get("far") for f in bugs), bugs


def test_updated_steps_start_after_the_first_differing_update():
    from tpdiag.diff.partials import updated_steps

    def row(step, phase, kind, bitwise):
        return {"step": step, "phase": phase, "kind": kind, "bitwise": bitwise}
    fwd = [row(s, "forward", "in", False) for s in range(3)]
    assert updated_steps(fwd + [row(0, "optimizer", "param", True), row(1, "optimizer", "param", True)]) == set()
    assert updated_steps(fwd + [row(0, "optimizer", "param", False)]) == {"1", "2"}
    assert updated_steps(fwd + [row(0, "optimizer", "param", True), row(1, "optimizer", "param", False)]) == {"2"}
    # a weight grad that differs is no update that differs (the update may round it away)
    assert updated_steps(fwd + [row(0, "backward", "param_grad", False)]) == set()


def _split(tmp_path_factory, case):
    def make(out):
        p = run_cli("compare", "--model", f"py:tests/models/planted/mega_split.py:{case}", "--tp", "1,2",
                    "--steps", "3", "--dtype", "bfloat16", "--no-confirm", "--no-baseline", "--out", str(out),
                    env={"OMP_NUM_THREADS": "1"})
        assert p.returncode == 0, p.stderr[-3000:] + p.stdout[-2000:]
    out = shared_run(tmp_path_factory, f"later-step-split-{case}", make)
    g = run_cli("gate", str(out), "--allow", "rounding")
    return json.loads((out / "summary.json").read_text()), g.returncode, g.stdout + g.stderr


def test_a_row_layers_partial_output_at_a_later_step_is_not_a_replica(tmp_path_factory):
    """Megatron's row layer with reduce_results=False (mega_split.py:split_ok, correct): its output is
    each rank's partial, handed as is to the module that reduces it. From step 1 on the partials add
    up to this side's sum, not the reference's, and main at 63a6c8e read that output
    `rank-inconsistent-replica` at step 1, gate 4 (the reduce's input was already left uncompared)."""
    s, gate, out = _split(tmp_path_factory, "split_ok")
    d = s["degrees"]["2"]
    assert s["class"] == "rounding" and d["class"] == "rounding", (s["class"], d.get("findings"))
    assert gate == 0, out
    left = set((d.get("not_compared") or {}).get("module_records") or ())
    assert {f"s{k}/forward/mlp.down/out#0/0" for k in range(3)} <= left, d.get("not_compared")


def test_a_row_layers_partial_never_reduced_stays_a_bug_at_later_steps(tmp_path_factory):
    # the negative control: the partial handed to plain code (the reduce forgotten) is no consumer's
    # reduced input at any step, so it stays a finding
    s, gate, out = _split(tmp_path_factory, "split_noreduce")
    d = s["degrees"]["2"]
    assert s["class"] == "bug" and gate == 4, out
    assert d["first_divergence"]["key"] == "s0/forward/mlp.down/out#0/0", d["first_divergence"]
    assert d["first_divergence"]["cause"] == "rank-inconsistent-replica", d["first_divergence"]
    left = set((d.get("not_compared") or {}).get("module_records") or ())
    assert not any(k.startswith(f"s{s_}/forward/mlp.down/out") for k in left for s_ in range(3)), left


def test_a_moe_router_grads_shares_at_a_later_step_are_not_a_replica_bug(tmp_path_factory):
    """moe_bwd_bug.py:shared_beside (a CORRECT hand-split top-2 MoE): the router's output grad is each
    rank's share (its experts'). In bf16 at --steps 3 the step-0 shares read `unknown` (within the near
    band, diff/partials.near_shares); at steps 1 and 2 - weights differ, the experts chosen anew - the
    shares' sum was 0.9-1.3 of the reference's norm off, and main at 63a6c8e read them
    `rank-inconsistent-replica`, BUG, gate 4. Now `unknown` (diff/partials.drifted_grad_shares): gate 1,
    as the run is at one step, never rounding."""
    def make(out):
        p = run_cli("compare", "--model", "py:tests/models/planted/moe_bwd_bug.py:shared_beside", "--tp", "1,2",
                    "--steps", "3", "--dtype", "bfloat16", "--no-confirm", "--no-baseline", "--out", str(out),
                    env={"OMP_NUM_THREADS": "1"})
        assert p.returncode == 0, p.stderr[-3000:] + p.stdout[-2000:]
    out = shared_run(tmp_path_factory, "later-step-moe-shared-beside", make)
    g = run_cli("gate", str(out), "--allow", "rounding")
    d = json.loads((out / "summary.json").read_text())["degrees"]["2"]
    found = [d["first_divergence"], *d.get("findings", ())]
    assert not [f for f in found if f.get("cause") in ("rank-inconsistent-replica", "sharding-bug")], found
    later = [f for f in found if f.get("module") == "sparse.router" and f.get("kind") == "grad_out"
             and f.get("step") in (1, 2)]
    assert len(later) == 2 and all(f["cause"] == "unknown" for f in later), later
    assert g.returncode == 1, g.stdout + g.stderr


def test_drifted_grad_shares_only_where_the_first_step_showed_shares():
    from tpdiag.diff.partials import drifted_grad_shares

    def row(step, phase="backward", kind="grad_out", module="router", **more):
        return {"step": step, "phase": phase, "kind": kind, "module": module, "call": 0, "name": "0",
                "bitwise": False, **more}
    moved = [row(0, "optimizer", "param", name="w")]
    # step 0 within the near band, step 1 (its weights differ) adding up to nothing: marked
    rows = [row(0, rank_consistent=False, rank_partial_near={"band": 1.0}), row(1, rank_consistent=False), *moved]
    drifted_grad_shares(rows, [])
    assert rows[1].get("rank_partial_drifted") == {"shares_at": "0"}, rows[1]
    # step 0's shares added up (left uncompared): marked too
    rows = [row(1, rank_consistent=False), *moved]
    drifted_grad_shares(rows, [{**row(0), "why": "unreduced partial sum (the ranks' copies add up to the reference)"}])
    assert rows[0].get("rank_partial_drifted"), rows[0]
    # negative controls: never shown shares (a replica that differs stays the replica check's BUG);
    # another module's shares; no update that differed; a forward record
    for rows, left in (([row(0, rank_consistent=True), row(1, rank_consistent=False), *moved], []),
                       ([row(0, module="other", rank_consistent=False, rank_partial_near={"band": 1.0}),
                         row(1, rank_consistent=False), *moved], []),
                       ([row(0, rank_consistent=False, rank_partial_near={"band": 1.0}), row(1, rank_consistent=False),
                         row(0, "optimizer", "param", name="w", bitwise=True)], []),
                       ([row(0, "forward", "in", rank_consistent=False, rank_partial_near={"band": 1.0}),
                         row(1, "forward", "in", rank_consistent=False), *moved], [])):
        drifted_grad_shares(rows, left)
        assert not any(r.get("rank_partial_drifted") for r in rows), rows
