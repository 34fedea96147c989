"""More of a user's hand-written TP mistakes (tests/models/planted/tp_misc.py), each beside its correct
twin, run as a user runs them: `tpdiag compare py:... --tp 1,2`, then `tpdiag gate`.

- embed_clamp: a vocab-parallel embedding whose last rank clamps other ranks' ids into its range
  (no mask): BUG at the embedding's forward.
- rope_bf16: a float32 model whose rotary table is built in bf16 at TP > 1 only: BUG at the rotary.
  Main at c2294f0 found it, but `tpdiag gate` exited 2 ("edited after the run"): the rotary module
  runs twice (q, then k) and the integrity check matched the second pass's findings by (phase,
  module, kind, name), taking call #1's for call #0's (records/integrity.py).
- scale_tp: a static loss scale undone in grad hooks, the replicated parameters' by S * TP: their
  grads 0.5x at TP=2. Main at c2294f0 read it `rounding only` (gate 1): the module's float64
  backward reproduces neither side (the hook rescales both), so "near" meant nothing; such a record
  is judged by one factor now (diff/oracle_own.py).
"""
import json

import pytest
import torch

from conftest import run_cli

CASES = ("embed_clamp", "embed_ok", "rope_bf16", "rope_ok", "scale_tp", "scale_ok")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for case in CASES:
        d = tmp_path_factory.mktemp(case) / "r"
        p = run_cli("compare", "--model", f"py:tests/models/planted/tp_misc.py:{case}", "--tp", "1,2",
                    "--no-baseline", "--no-confirm", "--out", str(d), env={"OMP_NUM_THREADS": "1"})
        assert p.returncode == 0, (case, p.stderr[-3000:] + p.stdout[-2000:])
        g = run_cli("gate", str(d))
        out[case] = (json.loads((d / "summary.json").read_text()), p.stdout, g.returncode, g.stdout + g.stderr)
    return out


@pytest.mark.parametrize("case", ["embed_ok", "rope_ok", "scale_ok"])
def test_the_twins_are_rounding_only(runs, case):
    s, stdout, gate, _ = runs[case]
    assert s["class"] == "rounding" and not s["degrees"]["2"].get("findings"), (case, s["degrees"]["2"])
    assert "BUG" not in stdout and gate == 1, (case, gate, stdout[-1500:])


@pytest.mark.parametrize("case,where,said", [
    ("embed_clamp", ("forward", "embed", "out"), "forward: embed"),
    ("rope_bf16", ("forward", "attn.rope", "out"), "forward: attn.rope"),
    ("scale_tp", ("backward", "head", "param_grad"), "backward: head (param_grad weight)"),
])
def test_each_mistake_is_a_bug_and_the_gate_says_so(runs, case, where, said):
    from tpdiag.diff.classes import leading_bug

    s, stdout, gate, gate_out = runs[case]
    lead = leading_bug(s["degrees"]["2"])
    assert s["class"] == "bug" and lead is not None, (case, s["degrees"]["2"])
    assert (lead["phase"], lead["module"], lead["kind"], lead["cause"]) == (*where, "sharding-bug"), lead
    assert f"BUG (a wrong result, not rounding) at TP=2 {said}" in stdout, stdout
    assert gate == 4, (case, gate_out)
    if case == "scale_tp":
        assert lead["why"].startswith("every element is 0.5x the reference's"), lead
        bugs = {(f["module"], f["name"]) for f in s["degrees"]["2"]["findings"] if f["cause"] == "sharding-bug"}
        assert bugs == {("head", "weight"), ("norm", "weight"), ("norm", "bias"), ("embed", "weight")}, bugs


def test_one_factor_judges_only_a_reference_that_is_its_float64_value_scaled():
    """diff/oracle_own.py's rule for a record far from its own float64 re-execution at the reference:
    the grad hook's mark is a reference that is one factor times that value (scale_tp: 1/S). A
    reference far from it by rounding alone - catastrophic cancellation, each row's output
    dominated by its mean's rounding, one offset the two sides round their own ways - also moves by
    "one factor" between the sides: on 626f7d4 it was given that factor (a BUG), not the near verdict."""
    from tpdiag.diff.oracle_own import _scaled_instead

    g = torch.Generator().manual_seed(0)
    f = 1e-7 * torch.randn(64, generator=g, dtype=torch.float64)   # x - mean, exactly
    y_ref, y_n = (f - 3e-5).float(), (f - 4.5e-5).float()        # each side's mean rounded its way
    row = {}
    assert not _scaled_instead(row, y_ref, y_n, f) and "scale" not in row
    # the hook: the reference S times below its module's float64 grad, this side 2S
    v = torch.randn(64, generator=g, dtype=torch.float64)
    row = {}
    assert _scaled_instead(row, (v / 1024).float(), (v / 2048).float(), v) and abs(row["scale"] - 0.5) < 1e-3
