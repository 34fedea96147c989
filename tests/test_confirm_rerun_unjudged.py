"""A confirmation's rerun (confirm/FIX/) runs no second pass: its first divergence at a micro-batch
configuration is named `batch-variant-kernel` by its bitwise-equal inputs alone (diff/judge.py's axis
rule), with no rounding bound. records/labels.unjudged_problems (hred13) read that as a label edited
after the run, so a correct MoE (tests/models/planted/moe_accum.py:global_index) at --micro-batch 2,1
was `gate` INCONCLUSIVE, exit 2 (reviewer hreview13, on c8df0f6). The check stays on the run itself."""
import json

from conftest import run_cli


def test_a_confirmation_rerun_without_a_second_pass_is_no_edited_label(tmp_path):
    d = tmp_path / "r"
    p = run_cli("compare", "--model", "py:tests/models/planted/moe_accum.py:global_index", "--tp", "1",
                "--micro-batch", "2,1", "--no-baseline", "--out", str(d), env={"OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-3000:] + p.stdout[-2000:]
    s = json.loads((d / "summary.json").read_text())
    conf = s["configurations"]["1-mb1"]["confirmation"]
    fix = conf["fix"]
    after = json.loads((d / "confirm" / fix / "summary.json").read_text())
    fd = after["configurations"]["1-mb1"]["first_divergence"]
    # the case: the rerun's first divergence is a forward record with no bound, labelled rounding
    assert fd["phase"] == "forward" and fd.get("bound") is None and "second_pass" not in after, fd
    g = run_cli("gate", str(d), "--allow", "rounding")
    assert g.returncode == 0, g.stdout[-2000:] + g.stderr[-2000:]
