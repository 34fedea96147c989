"""Expert-parallel experts told apart by their weights, not their shapes (tests/models/planted/
ep_dispatch.py). `megatron_even`: every local expert is sent as many tokens on both ranks, so
nothing differs in shape - each rank's `local_experts.0` was read as a rank-inconsistent replica,
a false BUG at `init` (gate 4); its weights are the reference's expert 0 and expert 2, so the MoE
block is compared at its boundary as with uneven counts. `megatron_seeded`: each rank draws its
experts from a seed of its own - its weights are none of the reference's, which the comparison at
the boundary must not hide: BUG, and the verdict says the experts are not the reference's.
`hand_sharded` (tests/models/planted/hand_sharded.py): weights cut per rank by hand are shards,
compared as before."""
import json

import pytest

from conftest import run_cli

SPEC = "py:tests/models/planted/ep_dispatch.py:"
ARGS = ("--tp", "1,2", "--no-baseline", "--no-confirm")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("epp")
    out = {}
    for name in ("megatron_even", "megatron_seeded", "hand_sharded", "keyed_bug"):
        d = base / name
        spec = "py:tests/models/planted/hand_sharded.py:target" if name == "hand_sharded" else SPEC + name
        extra = () if name == "hand_sharded" else ("--forward-only", "--capture", "hash") if name == "keyed_bug" \
            else ("--forward-only",)
        p = run_cli("compare", "--model", spec, *ARGS, *extra, "--out", str(d))
        assert p.returncode == 0, p.stderr[-3000:] + p.stdout[-3000:]
        out[name] = (d, json.loads((d / "summary.json").read_text()), p.stdout)
    return out


def test_experts_with_as_many_tokens_per_rank_are_placement_not_a_bug(runs):
    d, s, out = runs["megatron_even"]
    e = s["degrees"]["2"]
    assert s["status"] == "bitwise" and not e["findings"], (s["status"], e.get("first_divergence"), e["findings"])
    assert e["per_rank"]["moe"]["inside"] == ["moe.local_experts.0", "moe.local_experts.1"], e["per_rank"]
    assert "not_the_reference" not in e["per_rank"]["moe"]
    assert run_cli("gate", str(d), "--allow", "rounding").returncode == 0


def test_experts_seeded_per_rank_are_not_the_reference_s(runs):
    d, s, out = runs["megatron_seeded"]
    e = s["degrees"]["2"]
    assert s["class"] == "bug" and e["first_divergence"]["module"] == "moe", (s["class"], e["first_divergence"])
    assert "none of the reference's parameters" in e["per_rank"]["moe"]["not_the_reference"], e["per_rank"]
    assert "none of the reference's parameters" in out, out
    assert run_cli("gate", str(d), "--allow", "rounding").returncode == 4


def test_hand_sharded_weights_are_shards_and_their_grad_norm_sums_them(runs):
    # other bits of one shape per rank, like experts - but shards of the reference's weights: no
    # block, every record compared as before; a full step (the grad norm over every rank's shard)
    # is rounding only, where the norm over one rank's shard read BUG before
    d, s, out = runs["hand_sharded"]
    e = s["degrees"]["2"]
    assert s["backward"] and "per_rank" not in e and s["class"] == "rounding" and not e["findings"], (s["class"], e.get("per_rank"), e["findings"])
    assert e["first_divergence"]["cause"] == "row-parallel-reduction", e["first_divergence"]
    assert run_cli("gate", str(d), "--allow", "rounding").returncode == 0


def test_a_hash_first_run_s_region_pass_at_module_level_is_read_as_the_run_s(runs, monkeypatch):
    # hash capture: the region pass (the first divergence's whole values) cannot record the MoE's
    # op stream (other ops per rank) and falls back to module level, RUN_DIR/region-modules - a
    # directory the gate read as "not one tpdiag writes" (inconclusive, exit 2; on main also for
    # tests/models/ep_moe.py); it reads the BUG now
    d, s, out = runs["keyed_bug"]
    assert s["second_pass"]["dir"].rstrip("/").endswith("region-modules"), s["second_pass"]
    assert s["class"] == "bug" and s["degrees"]["2"]["first_divergence"]["module"] == "moe"
    assert run_cli("gate", str(d), "--allow", "rounding").returncode == 4
    from tpdiag.records import integrity

    # negative control: without the name, the same directory reads as tampered
    monkeypatch.setattr(integrity, "SECOND_PASS_DIRS", tuple(n for n in integrity.SECOND_PASS_DIRS if n != "region-modules"))
    problems = integrity._second_pass_problems(str(d), s, s["degrees"])
    assert any("not one tpdiag writes" in p for p in problems), problems


def test_the_gate_fails_weights_not_the_reference_s_even_where_the_block_reads_bitwise():
    # per-rank weights that are none of the reference's: another model whatever the block's output
    # shows. Where that output reads bitwise (no row is a violation) the gate judged nothing and
    # passed; the degree's per_rank entry is judged on its own now
    from tpdiag.gate.policy import load_policy, with_allowed
    from tpdiag.gate.degree import judge_degree

    d = {"status": "bitwise", "findings": [], "per_rank": {"moe": {"inside": ["moe.local_experts.0"],
                                                                   "not_the_reference": "moe.local_experts.0.w is none"}}}
    for allow in (None, "rounding"):
        res = judge_degree("2", d, [], with_allowed(load_policy(None), allow))
        assert res.status == "fail" and [v.cause for v in res.violations] == ["rank-inconsistent-replica"], res
        assert res.violations[0].module == "moe" and "none" in res.violations[0].reason
    # negative control: the same degree without the entry passes
    del d["per_rank"]["moe"]["not_the_reference"]
    assert judge_degree("2", d, [], load_policy(None)).status == "pass"


def test_a_reference_expert_hashed_stale_is_no_evidence_of_other_weights(runs):
    # a reference parameter changed in place between its record and its queued hash has no hash
    # (kernels/hash_buffer.py STALE): the per-rank experts that matched it matched "none of the
    # reference's parameters" - a false BUG. Read from the real seeded run, the reference's events
    # marked stale in memory as a hash capture marks them
    from tpdiag.diff.per_rank_weights import not_the_references
    from tpdiag.records.store import RecordSet

    d, s, _ = runs["megatron_seeded"]
    ref, other = RecordSet(str(d / "tp1")), RecordSet(str(d / "tp2"))

    def entry():
        e = json.loads(json.dumps(s["degrees"]["2"]))
        e["per_rank"]["moe"].pop("not_the_reference")
        return e

    e = entry()  # positive control: the seeded experts are none of the reference's
    not_the_references(e, ref, other, "2", [])
    assert "none of the reference's parameters" in e["per_rank"]["moe"]["not_the_reference"]

    def stale(pick):
        for m in ref.events:
            if m["kind"] == "param_init" and pick(m["module"]):
                m.update(hash=None, full_hash=None, hash_layout="stale")

    stale(lambda mod: not mod.startswith("moe."))  # outside the block: the experts' own hashes still tell
    e = entry()
    not_the_references(e, ref, other, "2", [])
    assert "not_the_reference" in e["per_rank"]["moe"] and "weights_unchecked" not in e["per_rank"]["moe"]
    stale(lambda mod: mod.startswith("moe.local_experts."))
    e = entry()
    not_the_references(e, ref, other, "2", [])
    pr = e["per_rank"]["moe"]
    assert "not_the_reference" not in pr, pr
    assert "changed in place before it was hashed" in pr["weights_unchecked"], pr


def test_one_stale_reference_expert_excuses_no_more_weights_than_itself(runs):
    # each unhashed reference parameter can be at most one of the per-rank weights: one stale expert
    # parameter left every seeded weight of the block unchecked (a check weakened, helper hreview7)
    from tpdiag.diff.per_rank_weights import not_the_references
    from tpdiag.records.store import RecordSet

    d, s, _ = runs["megatron_seeded"]
    ref, other = RecordSet(str(d / "tp1")), RecordSet(str(d / "tp2"))
    experts = [m for m in ref.events if m["kind"] == "param_init" and m["module"].startswith("moe.local_experts.")]
    assert len(experts) > 1, experts
    experts[0].update(hash=None, full_hash=None, hash_layout="stale")
    e = json.loads(json.dumps(s["degrees"]["2"]))
    e["per_rank"]["moe"].pop("not_the_reference")
    not_the_references(e, ref, other, "2", [])
    pr = e["per_rank"]["moe"]
    assert "none of the reference's parameters" in pr.get("not_the_reference", ""), pr
    assert "weights_unchecked" not in pr, pr
