"""The CLI's verdict, summary.json's class and `tpdiag gate` agree on a bug only the op-level second
pass finds (helper hbug14; tests/models/planted/tiny_term.py).

centre_world: a block's small centring term `h - 1e-7 * c` whose c is scaled by the world size
although every rank holds the whole row. The block's output moves within its rounding (the module's
float64 re-execution: near), while the op-level pass re-executes the multiply in float64 and finds it
2.1e6x beyond rounding: a `sharding-bug` finding on an op record only that pass made. On main at
da9eec2 compare printed BUG (class bug, --fail-on-divergence 4) but `tpdiag gate` judged diff.csv's
rows alone - the first divergence's rounding label - and exited 1 (0 with --allow rounding). The gate
now judges such findings too (gate/verdict.py `_beside_rows`). Its twin centre_ok is bitwise.
"""
import json

import pytest

from conftest import run_cli

SPEC = "py:tests/models/planted/tiny_term.py:"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for case in ("centre_world", "centre_ok"):
        d = tmp_path_factory.mktemp(case) / "r"
        p = run_cli("compare", "--model", SPEC + case, "--tp", "1,2", "--no-baseline", "--no-confirm",
                    "--fail-on-divergence", "--out", str(d), env={"OMP_NUM_THREADS": "1"})
        out[case] = (d, json.loads((d / "summary.json").read_text()), p)
    return out


def test_a_bug_only_the_op_pass_finds_fails_the_gate_as_a_bug(runs):
    d, s, p = runs["centre_world"]
    e = s["degrees"]["2"]
    assert s["class"] == "bug" and "BUG" in p.stdout and p.returncode == 4, (p.returncode, p.stdout[-2000:])
    # the first divergence itself reads rounding: the bug is a finding on an op record of the second pass
    from tpdiag.records.causes import cause_class

    assert cause_class(e["first_divergence"]["cause"]) == "rounding", e["first_divergence"]
    bug = [f for f in e["findings"] if f["cause"] == "sharding-bug"]
    assert bug and bug[0]["kind"] == "op" and bug[0].get("from") == "second pass", e["findings"]
    for more in ((), ("--allow", "rounding")):
        g = run_cli("gate", str(d), *more)
        assert g.returncode == 4, (more, g.stdout[-2000:])
        assert "sharding-bug" in g.stdout.splitlines()[0], g.stdout[-2000:]


def test_its_twin_is_bitwise(runs):
    d, s, p = runs["centre_ok"]
    assert s["status"] == "bitwise" and p.returncode == 0, p.stdout[-2000:]
    assert run_cli("gate", str(d)).returncode == 0
