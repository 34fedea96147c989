"""Each rank's own statistic of a column-parallel hidden width, combined over the ranks by hand - a
softmax's max, a LayerNorm's moments (tests/models/planted/vocab_lookup.py,
helper hbug13d), run as a user runs it: `tpdiag compare py:... --tp 1,2`, then `tpdiag gate`.

- gate_rescale: online softmax - each rank subtracts its OWN max, then rescales its exp terms by
  exp(m_r - max) after an all-reduce of the maxes: mathematically the whole width's softmax.
  Main at 2cd4cc0 read it BUG (`forward: ffn (op aten::sub#0.0)`, 5.5e5x): the op-level rerun
  judged `h - m_r` against TP=1's float64 `h - max` although m_r (the shard's amax, left uncompared:
  "each rank computed its own part") is another number per rank that the module's later all-reduce
  shifts away. Such an op is not judged now (diff/op_inputs.py: after_uncompared_op); the module's
  own float64 verdict reads rounding.
- gate_rescale_module: the same, the maxes all-reduced by a module of its own (ffn.max_ranks). Main
  read BUG there too (gate 4): the op `h - m_r` (the collective in the submodule's records, outside
  the op window) and ffn.max_ranks's input, each rank's own max, read as a wrong replica. That
  input - the ranks' copies having TP=1's value as their elementwise max, the module's output one
  value on every rank - is a share of a MAX now (diff/partials.py), left uncompared as a partial sum is.
- gate_rescale_sign: that module's rescale with its sign flipped - BUG at ffn (the max's shares
  being uncompared hides no bug).
- chan_ok: a LayerNorm over the hidden width from each shard's (mean, M2), combined by Chan's
  formula after an all-gather in ffn's own code: main read BUG at `ffn (op aten::sub#0.0)` (h -
  mean_r), 2.5e5x, as gate_rescale; rounding now.
- chan_module: the same LayerNorm over the hidden width from each shard's (mean, M2), combined by Chan's
  formula in a module of its own (ffn.combine) after an all-gather. Main read BUG (gate 4) at
  ffn.combine's input: the ranks' own means, neither replicas nor shares of a sum. The combining
  module's outputs being 1000x or more closer to the reference than those inputs, they are the
  ranks' own values (diff/partials.py), left uncompared; rounding. chan_within (the spread of the
  shards' means left out of the variance) stays BUG at ffn.
- gate_local: the rank's own max kept, the ranks' exp-sums summed unscaled: another function, BUG
  at `forward: ffn`, gate 4 (before and after).
"""
import json

import pytest

from conftest import run_cli

SPEC = "py:tests/models/planted/vocab_lookup.py:"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for case in ("gate_rescale", "gate_rescale_module", "chan_ok", "chan_module", "gate_local", "gate_rescale_sign", "chan_within"):
        d = tmp_path_factory.mktemp(case) / "r"
        p = run_cli("compare", "--model", SPEC + case, "--tp", "1,2", "--no-baseline", "--no-confirm",
                    "--out", str(d), env={"OMP_NUM_THREADS": "1"})
        assert p.returncode == 0, (case, p.stderr[-3000:] + p.stdout[-2000:])
        out[case] = (json.loads((d / "summary.json").read_text()), p.stdout, run_cli("gate", str(d)).returncode)
    return out


@pytest.mark.parametrize("case", ["gate_rescale", "gate_rescale_module", "chan_ok", "chan_module"])
def test_own_values_combined_right_are_rounding_only(runs, case):
    s, stdout, gate = runs[case]
    d = s["degrees"]["2"]
    assert s["class"] == "rounding", d.get("findings")
    assert not [f for f in d.get("findings", []) if f.get("cause") == "sharding-bug"], d["findings"]
    assert d["first_divergence"]["module"] in ("ffn", "ffn.combine") and d["first_divergence"]["oracle"]["far"] is False
    assert "BUG" not in stdout and gate == 1, (gate, stdout[-1500:])


@pytest.mark.parametrize("case", ["gate_local", "gate_rescale_sign", "chan_within"])
def test_own_values_combined_wrong_are_a_bug(runs, case):
    from tpdiag.diff.classes import leading_bug

    s, stdout, gate = runs[case]
    lead = leading_bug(s["degrees"]["2"])
    assert s["class"] == "bug" and lead is not None and gate == 4
    assert (lead["phase"], lead["module"], lead["cause"]) == ("forward", "ffn", "sharding-bug"), lead
