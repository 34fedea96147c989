"""Megatron's split row-parallel layer (helper hbug14; tests/models/planted/mega_split.py):
`RowParallelLinear(input_is_parallel=True, skip_bias_add=True)` with reduce_results=False returns
this rank's PARTIAL sum and its bias, and a module of its own (`ReduceFromTP`) all-reduces it.

On main at da9eec2 the correct split_ok read BUG, gate 4: the row layer's output, each rank's share
of the sum, was taken for a replica (`rank-inconsistent-replica`, its float64 re-execution 8e5x
"beyond rounding"). A module output whose ranks' copies add up to the reference, handed as is (the
same bytes) to consumers that each reduce it, is now left uncompared as a partial
(diff/partials.reduced_outputs), as that consumer's input already was; the reduce's output is the first divergence: `row-parallel-reduction`, rounding, gate 1 - under
`--capture hash` too (the region pass reads the shares whole and names the all-reduce:
runner/drill.py). Its buggy twins stay BUG, gate 4: the bias added on every rank before the reduce
and the reduce forgotten: the row layer's partial is then handed to plain code, no module that
reduces it as is, and stays a finding (`rank-inconsistent-replica` at `mlp.down`).
"""
import json

import pytest

from conftest import run_cli

SPEC = "py:tests/models/planted/mega_split.py:"
CASES = ("split_ok", "split_bias_rank", "split_noreduce", "split_ok-hash", "split_bias_rank-hash")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for case in CASES:
        d = tmp_path_factory.mktemp(case) / "r"
        more = ("--capture", "hash") if case.endswith("-hash") else ()
        p = run_cli("compare", "--model", SPEC + case.removesuffix("-hash"), "--tp", "1,2", "--no-baseline",
                    "--no-confirm", *more, "--out", str(d), env={"OMP_NUM_THREADS": "1"})
        assert p.returncode == 0, (case, p.stderr[-3000:] + p.stdout[-2000:])
        out[case] = (json.loads((d / "summary.json").read_text()), p.stdout, run_cli("gate", str(d)).returncode)
    return out


@pytest.mark.parametrize("case", ["split_ok", "split_ok-hash"])
def test_a_partial_returned_to_a_reducing_module_is_rounding(runs, case):
    s, stdout, gate = runs[case]
    e = s["degrees"]["2"]
    fd = e["first_divergence"]
    assert s["class"] == "rounding" and "BUG" not in stdout and gate == 1, (gate, fd, e.get("findings"))
    assert (fd["module"], fd["kind"], fd["cause"]) == ("mlp.reduce", "out", "row-parallel-reduction"), fd
    assert "s0/forward/mlp.down/out#0/0" in e["not_compared"]["module_records"], e["not_compared"]
    assert not e.get("findings"), e["findings"]


@pytest.mark.parametrize("case", ["split_bias_rank", "split_noreduce", "split_bias_rank-hash"])
def test_the_bias_on_every_rank_or_the_reduce_forgotten_is_a_bug(runs, case):
    from tpdiag.diff.classes import leading_bug

    s, stdout, gate = runs[case]
    lead = leading_bug(s["degrees"]["2"])
    assert s["class"] == "bug" and gate == 4 and "BUG" in stdout, s["degrees"]["2"]["first_divergence"]
    # the row layer's partial, handed to no module that reduces it as is (plain code adds the bias to it,
    # or takes it for a replica), stays a finding: the first record showing the mistake
    assert lead["key"] == "s0/forward/mlp.down/out#0/0", lead
    assert lead["cause"] == "rank-inconsistent-replica", lead
