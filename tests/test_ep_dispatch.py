"""A user's expert-parallel MoE written the Megatron-LM / DeepSpeed way (tests/models/planted/
ep_dispatch.py: a sequence split, an all-to-all of uneven splits, each rank's own experts as
submodules - a ModuleList of local experts, or a ModuleDict keyed by the global expert id). Its
ranks record other modules or other shapes inside the MoE block, so every such run was
inconclusive ("the model is not SPMD under this plan", exit 2 at the gate). The block is compared
at its boundary now, and the verdict says so: the correct models are bitwise (forward and a full
step: the grad norm counts each rank's own experts), the planted bugs are a BUG at the block,
gate exit 4."""
import csv
import json

import pytest

from conftest import run_cli

SPEC = "py:tests/models/planted/ep_dispatch.py:"
ARGS = ("--tp", "1,2", "--no-baseline", "--no-confirm")
RUNS = {"megatron": (), "keyed": ("--forward-only",), "megatron_bug": ("--forward-only",), "keyed_bug": (),
        # hash capture (the default above 100M parameters), a full step
        "megatron_even@hash": ("--capture", "hash"), "keyed_bug@hash": ("--capture", "hash")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("epd")
    out = {}
    for name, extra in RUNS.items():
        d = base / name.replace("@", "_")
        p = run_cli("compare", "--model", SPEC + name.split("@")[0], *ARGS, *extra, "--out", str(d))
        assert p.returncode == 0, p.stderr[-3000:] + p.stdout[-3000:]
        out[name] = (d, json.loads((d / "summary.json").read_text()), p.stdout)
    return out


def _per_rank(s):
    return s["degrees"]["2"].get("per_rank") or {}


@pytest.mark.parametrize("name", ["megatron", "keyed"])
def test_the_correct_models_read_rounding_at_most(runs, name):
    d, s, out = runs[name]
    e = s["degrees"]["2"]
    assert s["status"] in ("bitwise", "divergent") and s.get("class") in (None, "rounding") and not e["findings"], (
        s["status"], s.get("class"), e.get("error"), e.get("first_divergence"), e["findings"])
    inside = _per_rank(s)["moe"]["inside"]
    experts = "moe.local_experts." if name == "megatron" else "moe.experts."
    # the experts are left out; the router, the same module on every rank, is compared
    assert inside and all(m.startswith(experts) for m in inside), inside
    assert "compared at its boundary only" in out and "not SPMD" not in out, out
    assert run_cli("gate", str(d), "--allow", "rounding").returncode == 0


def test_the_forward_is_bitwise_at_the_blocks_boundary(runs):
    # forward only: the all-to-all puts every token back, each expert ran the same rows in the same
    # order as at TP=1 - the block's output is bitwise
    _, s, _ = runs["keyed"]
    assert s["status"] == "bitwise", s["degrees"]["2"].get("first_divergence")


def test_a_full_step_is_rounding_where_the_router_grad_is_summed(runs):
    # each rank's router grad covers its own tokens, summed over the ranks: rounding at the
    # router's weight grad - compared, as the router is the same module on every rank. The grad
    # norm counts every rank's experts: over one rank's parameters it was a false
    # rank-inconsistent-replica BUG at `optimizer: grad_norm total` (gate 4)
    d, s, _ = runs["megatron"]
    fd = s["degrees"]["2"]["first_divergence"]
    assert (fd["module"], fd["phase"], fd["kind"]) == ("moe.router", "backward", "param_grad"), fd
    assert not fd["oracle"]["far"] and s["class"] == "rounding", (fd["oracle"], s["class"])
    norm = [r for r in csv.DictReader(open(d / "diff.csv")) if r["kind"] == "grad_norm"]
    assert norm and norm[0]["rank_consistent"] == "True", norm


@pytest.mark.parametrize("name", ["megatron_bug", "keyed_bug"])
def test_the_planted_bugs_are_a_bug_at_the_moe_block(runs, name):
    d, s, out = runs[name]
    fd = s["degrees"]["2"]["first_divergence"]
    assert fd["module"] == "moe" and fd["phase"] == "forward", fd
    assert fd["cause"] == "sharding-bug" and s["class"] == "bug", (fd["cause"], s["class"])
    assert fd["oracle"]["far"], fd["oracle"]
    assert "moe" in _per_rank(s) and "BUG" in out.splitlines()[0], out
    assert run_cli("gate", str(d), "--allow", "rounding").returncode == 4


def test_a_block_is_found_only_where_its_own_records_agree():
    from tpdiag.runner.per_rank import boundaries

    def m(module, kind, shape, phase="forward", k=None):
        return {"key": k or f"{phase}/{module}/{kind}", "module": module, "kind": kind, "phase": phase,
                "dtype": "float32", "local_shape": shape}

    common = [m("embed", "out", [2, 4]), m("moe", "in", [2, 4]), m("moe", "out", [2, 4])]
    r0 = common + [m("moe.experts.0", "out", [3, 4]), m("moe", "op", [5], k="op/moe/a2a")]
    r1 = common + [m("moe.experts.2", "out", [1, 4]), m("moe", "op", [3], k="op/moe/a2a")]
    assert boundaries([r0, r1]) == {"moe": ["moe.experts.0", "moe.experts.2"]}
    # only ops differ: not this module's business (the second pass falls back to module level)
    assert boundaries([common + [r0[-1]], common + [r1[-1]]]) is None
    # a top-level module differs: no block holds it - inconclusive, as before
    assert boundaries([common + [m("head", "out", [2, 3])], common + [m("head", "out", [2, 5])]]) is None
    # the block's own output differs per rank: no boundary there either
    bad = [m("embed", "out", [2, 4]), m("moe", "out", [2, 4]), m("moe.x", "out", [1])]
    bad1 = [m("embed", "out", [2, 4]), m("moe", "out", [3, 4]), m("moe.x", "out", [2])]
    assert boundaries([bad, bad1]) is None


def test_an_expert_with_as_many_tokens_on_every_rank_is_still_left_out():
    # local_experts.0 can be sent as many tokens on both ranks: its records then have one shape,
    # but its weights are another expert's per rank - left out with its siblings; the router (one
    # module on every rank) is kept
    from tpdiag.runner.per_rank import _per_rank_inside, boundaries

    def m(module, kind, shape, h=None):
        return {"key": f"{module}/{kind}", "module": module, "kind": kind, "phase": "forward",
                "dtype": "float32", "local_shape": shape, "hash": h}

    r = [[m("moe", "in", [4]), m("moe", "out", [4]), m("moe.router", "param_init", [2], "r"),
          m("moe.router", "out", [2, 4]), m(f"moe.le.0", "param_init", [3], f"e{e0}"), m("moe.le.0", "out", [5, 4]),
          m("moe.le.1", "out", [n1, 4])] for e0, n1 in ((0, 2), (2, 6))]
    ref = {"moe.le.0/param_init": [3], "moe.router/param_init": [2]}  # the reference's parameter shapes
    blocks = boundaries(r, ref)
    assert blocks == {"moe": ["moe.le.0", "moe.le.1"]}, blocks
    assert _per_rank_inside(r, blocks) == {"moe.le.0", "moe.le.1"}
    # only the expert's inner Linear holds weights (other per rank); the expert's output has one
    # shape but is another expert's rows on each rank (other bits): no block there - moe's output,
    # the same bits on every rank, is
    r = [[m("moe", "in", [4], "x"), m("moe", "out", [4], "y"), m("moe.le.0.fc", "param_init", [3], f"w{k}"),
          m("moe.le.0.fc", "out", [5, 4], f"o{k}"), m("moe.le.0", "out", [5, 4], f"o{k}")] for k in range(2)]
    ref = {"moe.le.0.fc/param_init": [3]}
    assert boundaries(r, ref) == {"moe": ["moe.le.0.fc"]}, boundaries(r, ref)
    # a hand-sharded weight (the reference's is whole, twice as large) is a shard, not another
    # module per rank: no block, the gather rebuilds it as before
    assert boundaries(r, {"moe.le.0.fc/param_init": [6]}) is None
    assert boundaries(r) is None  # no reference to tell: the parameter signal is not used


def test_hash_capture_tells_experts_with_even_token_counts_from_replicas(runs):
    # every expert sent as many tokens on both ranks: one shape per record everywhere, and under hash
    # capture the records held no per-rank hash - the experts' weights read as a replica that differs
    # per rank: a false rank-inconsistent-replica BUG at init, gate 4. Each rank's own hashes (from
    # its lanes) tell them apart now, and each is one of the reference's parameters (its full_hash)
    d, s, out = runs["megatron_even@hash"]
    e = s["degrees"]["2"]
    assert s.get("class") in (None, "rounding") and not e["findings"], (s.get("class"), e.get("first_divergence"))
    assert _per_rank(s)["moe"]["inside"] == ["moe.local_experts.0", "moe.local_experts.1"], _per_rank(s)
    assert "none of the reference's parameters" not in out, out
    assert run_cli("gate", str(d), "--allow", "rounding").returncode == 0


def test_hash_capture_bug_behind_a_block_gates_4(runs):
    # the hash-first run's region pass falls back to module level (region-modules/) and its own-input
    # pass (region-modules/ops/) finds a bug behind the block: the gate read that finding as edited
    # after the run (it looked for the nested pass under region/ only) - exit 2, "INCONCLUSIVE"
    d, s, out = runs["keyed_bug@hash"]
    assert s["class"] == "bug" and s["degrees"]["2"]["first_divergence"]["module"] == "moe", s["degrees"]["2"]
    g = run_cli("gate", str(d), "--allow", "rounding")
    assert g.returncode == 4, g.stdout[-2000:] + g.stderr[-2000:]
