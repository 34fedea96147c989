"""`--steps 2`: the second step's records judged as the first's, as a user runs it.

- The built-in model at TP=1,2 over two steps is rounding only. Main at c2294f0 read it `BUG ...
  forward: tok_embeddings, 15.2x beyond rounding` at step 1 (and every Linear of step 1): the
  own-input float64 re-execution is the REFERENCE's module on this side's inputs, and from step 1 on
  this side's parameters are its own update's - another rounding of the same step, not the
  reference's. Such a record now gets no own-input verdict (diff/oracle_own.py, params_equal).
- A user's mistake that only step 1 shows (tests/models/planted/step_stale.py: an all-reduce memoised
  by shape at TP > 1, so step 1 returns step 0's reduced output) is still a BUG there, at its module;
  its twin (the memo keyed by the input itself) is rounding only. The twin read BUG at step 0 on main:
  the memo module's input is each rank's partial sum, which it reduces itself - read as a replica
  whose ranks differ (diff/partials.reduced).
"""
import json

import pytest

from conftest import run_cli, shared_run


def _steps2(tmp_path_factory, name, *model):
    def make(out):
        p = run_cli("compare", *model, "--tp", "1,2", "--steps", "2", "--no-confirm", "--no-baseline",
                    "--out", str(out), env={"OMP_NUM_THREADS": "1"})
        assert p.returncode == 0, p.stderr[-3000:] + p.stdout[-2000:]
    out = shared_run(tmp_path_factory, name, make)
    g = run_cli("gate", str(out))
    return json.loads((out / "summary.json").read_text()), g.returncode, g.stdout + g.stderr


def test_the_built_in_model_over_two_steps_is_rounding_only(tmp_path_factory):
    s, gate, out = _steps2(tmp_path_factory, "tp12-steps2")  # shared with test_tamper_numbers
    d = s["degrees"]["2"]
    assert s["class"] == "rounding" and not d.get("findings"), d.get("findings")
    assert gate == 1, out


@pytest.mark.parametrize("case", ["stale_reduce", "fresh_reduce"])
def test_a_mistake_only_the_second_step_shows(tmp_path_factory, case):
    from tpdiag.diff.classes import leading_bug

    s, gate, out = _steps2(tmp_path_factory, f"steps2-{case}",
                           "--model", f"py:tests/models/planted/step_stale.py:{case}")
    d = s["degrees"]["2"]
    if case == "fresh_reduce":
        assert s["class"] == "rounding" and not d.get("findings"), d.get("findings")
        assert gate == 1, out
        return
    lead = leading_bug(d)
    assert s["class"] == "bug" and lead is not None, d
    assert lead["key"].startswith("s1/forward/mlp.reduce/"), lead
    assert not any(f["key"].startswith("s0/") for f in d["findings"]), d["findings"]
    assert gate == 4, out
