"""Expert-parallel experts told apart by their weights, not their shapes (tests/models/planted/
ep_dispatch.py). `megatron_even`: every local expert is sent as many tokens on both ranks, so
nothing differs in shape - each rank's `local_experts.0` was read as a rank-inconsistent replica,
a false BUG at `init` (gate 4); its weights are the reference's expert 0 and expert 2, so the MoE
block is compared at its boundary as with uneven counts. `megatron_seeded`: each rank draws its
experts from a seed of its own - its weights are none of the reference's, which the comparison at
the boundary must not hide: BUG, and the verdict says the experts are not the reference's."""
import json

import pytest

from conftest import run_cli

SPEC = "py:tests/models/planted/ep_dispatch.py:"
ARGS = ("--tp", "1,2", "--forward-only", "--no-baseline", "--no-confirm")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("epp")
    out = {}
    for name in ("megatron_even", "megatron_seeded"):
        d = base / name
        p = run_cli("compare", "--model", SPEC + name, *ARGS, "--out", str(d))
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
