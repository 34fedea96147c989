"""A rank-divergent buffer held by a module that is never called itself (tests/models/planted/
stats_elsewhere.py: `moe.balance` holds the balancing state the `moe` around it reads and writes).
On b260af8 diff/replicas.py asked only the owner's next forward whether the buffer is read: "not read
by any recorded step: moe.balance is not called again" - held_elsewhere, whose next step routes by the
per-rank bias, read `unknown` at its first divergence. The nearest module above the owner that is
called at the next step is asked now; "unread" needs it and every module above it bitwise there, and
every grad of that step's backward: held_backward reads `seen` in a custom backward only (its forward
bitwise at every step) and read `unknown`, gate 1, with no BUG anywhere - on b260af8, and with the
first half of this fix alone."""
import json

import pytest

from conftest import run_cli


@pytest.mark.parametrize("case", ["held_elsewhere", "held_logged", "held_backward"])
def test_a_buffer_held_by_an_uncalled_module_is_judged_by_its_reader(case, tmp_path):
    from tpdiag.diff.classes import leading_bug

    d = tmp_path / "r"
    p = run_cli("compare", "--model", f"py:tests/models/planted/stats_elsewhere.py:{case}", "--tp", "1,2",
                "--steps", "2", "--no-confirm", "--no-baseline", "--out", str(d), env={"OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-3000:] + p.stdout[-2000:]
    e = json.loads((d / "summary.json").read_text())["degrees"]["2"]
    fd = e["first_divergence"]
    gate = run_cli("gate", str(d)).returncode
    if case == "held_logged":  # the twin: `seen` read by nothing
        assert (fd["key"], fd["cause"]) == ("s0/optimizer/moe.balance/buffer#0/seen", "unknown"), fd
        assert "not read by any recorded step: moe's forward at step 1 is bitwise" in fd["why"], fd["why"]
        assert leading_bug(e) is None and gate == 1, (gate, p.stdout[-2000:])
        return
    if case == "held_backward":
        assert (fd["key"], fd["cause"]) == ("s0/optimizer/moe.balance/buffer#0/seen", "rank-inconsistent-replica"), fd
        assert "its forward is bitwise, but its backward is not" in fd["why"], fd["why"]
        assert leading_bug(e) is not None and gate == 4, (gate, e.get("findings"))
        return
    assert (fd["key"], fd["cause"]) == ("s0/optimizer/moe.balance/buffer#0/bias", "rank-inconsistent-replica"), fd
    assert "step 1 reads it: moe's forward output there differs" in fd["why"], fd["why"]
    lead = leading_bug(e)
    assert lead is not None and lead["key"] == fd["key"], lead
    assert gate == 4


@pytest.fixture(scope="module")
def later(tmp_path_factory):
    from conftest import compare_planted

    return compare_planted(tmp_path_factory, {
        "after_warmup": ("replica_later", "after_warmup", ("--tp", "1,2", "--steps", "3")),
        "beside": ("replica_later", "beside", ("--tp", "1,2", "--steps", "2"))})


@pytest.mark.parametrize("case,step", [("after_warmup", 2), ("beside", 1)])
def test_a_replica_read_later_or_beside_its_owner_is_read(later, case, step):
    """tests/models/planted/replica_later.py: a per-rank amax (its MAX all-reduce forgotten) read by
    `quant`, a module beside its owner. after_warmup: written at step 0 only, first read at step 2 (a
    warm-up step between): on 170f498 step 1 alone was asked - "not read by any recorded step", cause
    `unknown`. beside: read at the next step by `quant` while the owner's own output never changes:
    on 170f498 "whether step 1 reads it is not shown". Every step until the buffer is written again is
    asked now, and a step whose first record that differs across ranks is a module's output, its inputs
    and parameters the same on every rank, reads per-rank state: rank-inconsistent-replica, read."""
    from tpdiag.diff.classes import leading_bug

    s, stdout, gate = later[case]
    e = s["degrees"]["2"]
    fd = e["first_divergence"]
    assert (fd["key"], fd["cause"]) == ("s0/optimizer/block.observer/buffer#0/amax", "rank-inconsistent-replica"), fd
    assert f"step {step} reads per-rank state: block.quant's forward output" in fd["why"], fd["why"]
    assert leading_bug(e)["key"] == fd["key"] and gate == 4, (gate, stdout[-2000:])
