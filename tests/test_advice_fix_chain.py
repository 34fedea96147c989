"""`compare --fix auto` whose chain ends bitwise said "keep them on where you need bitwise equality"
and not how: the line now gives the `tpdiag.invariant` call with the chain's fixes, and that call,
copied from the line, runs."""
import re

import torch
from torch import nn


def test_a_bitwise_fix_chain_says_how_to_train_with_its_fixes():
    from tpdiag.cli.advice import what_to_do

    chain = [{"round": 0, "fixes": []}, {"round": 1, "fixes": ["tp-invariant-linear"]},
             {"round": 2, "fixes": ["tp-invariant-linear", "invariant-norm-grad"]}]
    line = what_to_do({"status": "divergent", "class": "rounding", "fix_chain": chain,
                       "status_after_fixes": "bitwise"})
    assert line.startswith("nothing is wrong: the fixes of the chain above remove every difference"), line
    call = re.search(r"`with (tpdiag\.invariant\(model, plan, fixes=\"([^\"]+)\", tree_groups=G\)):`", line)
    assert call and call.group(2) == "tp-invariant-linear,invariant-norm-grad", line
    # the call as the line writes it, G = 2, on a model at TP=1 (the same plan, unapplied)
    import tpdiag

    model = nn.Sequential(nn.Linear(8, 16), nn.RMSNorm(16), nn.Linear(16, 8))
    plan = {"0": "colwise", "2": "rowwise"}
    with eval(call.group(1).replace("G", "2"), {"tpdiag": tpdiag, "model": model, "plan": plan}):
        model(torch.randn(2, 8)).sum().backward()
    # a chain that ends divergent gives no call
    line = what_to_do({"status": "divergent", "class": "rounding", "fix_chain": chain,
                       "status_after_fixes": "divergent"})
    assert "tpdiag.invariant" not in line


def test_a_fix_already_on_is_not_advised_again():
    # Gemma3 under --fix all: the norm-weight-grad left is rounding, and its fix was on (the norm's
    # x * (1 + w) form is not one invariant-norm-grad wraps): `--fix auto` would change nothing
    from tpdiag.cli.advice import what_to_do

    def summary(reason):
        return {"status": "divergent", "class": "rounding", "degrees": {"2": {
            "status": "divergent", "first_divergence": {"cause": "norm-weight-grad"},
            "confirmation": {"fix": "invariant-norm-grad", "verdict": "no-fix", "reason": reason}}}}

    line = what_to_do(summary("invariant-norm-grad was already on"))
    assert "already on" in line and "--fix auto` would not remove it" in line, line
    # control: a cause with no fix at all keeps the usual advice
    line = what_to_do(summary("no available fix for cause 'norm-weight-grad'"))
    assert "already on" not in line and "`tpdiag compare --fix auto` applies the fixes" in line, line


def test_a_fix_already_on_at_one_degree_still_advises_auto_for_another():
    # TP=2's cause's fix was on, TP=4's cause has a fix that was off: `--fix auto` can still remove
    # TP=4's difference, so the line must not say it would not (helper hreview7)
    from tpdiag.cli.advice import what_to_do

    def entry(reason, fix):
        return {"status": "divergent", "first_divergence": {"cause": "norm-weight-grad"},
                "confirmation": {"fix": fix, "verdict": "no-fix", "reason": reason}}

    line = what_to_do({"status": "divergent", "class": "rounding", "degrees": {
        "2": entry("invariant-norm-grad was already on", "invariant-norm-grad"),
        "4": {"status": "divergent", "first_divergence": {"cause": "row-parallel-reduction"},
              "confirmation": {"fix": "tp-invariant-linear", "verdict": "confirmed"}}}})
    assert "would not remove it" not in line and "`tpdiag compare --fix auto` applies the fixes" in line, line
    # control: both degrees' fixes already on
    line = what_to_do({"status": "divergent", "class": "rounding", "degrees": {
        "2": entry("invariant-norm-grad was already on", "invariant-norm-grad"),
        "4": entry("invariant-norm-grad was already on", "invariant-norm-grad")}})
    assert "`--fix auto` would not remove it" in line, line


def test_a_capture_whose_difference_arises_between_probed_modules_says_what_to_do():
    """A capture of a qk-norm over the local columns (F.rms_norm inside the attention's own forward)
    read `cause unknown: ... no op there was recorded` and then only "nothing could judge the first
    divergence" (helper hnew14): the line now says how to give that code a record."""
    from tpdiag.cli.advice import what_to_do
    from tpdiag.diff.generic_bound import why_unknown

    fd = {"phase": "forward", "module": "layers.0.attention", "kind": "in", "name": "0", "cause": "unknown"}
    fd["why"] = why_unknown({**fd, "module": "layers.0.attention.wo"})

    def summary(source):
        return {"status": "divergent", "class": "unknown", "source": source, "run_dir": "runs/d",
                "degrees": {"2": {"status": "divergent", "first_divergence": fd}}}

    line = what_to_do(summary("capture"))
    assert "move that code into a submodule of its own" in line and "tpdiag compare --model py:" in line, line
    assert line.endswith("`tpdiag report runs/d` shows its values"), line
    # a compare run's own second pass records those ops: the advice for it is unchanged
    assert what_to_do(summary(None)).startswith("nothing could judge the first divergence"), what_to_do(summary(None))


def test_a_fix_chain_round_names_the_record_as_the_table_does():
    """`--fix auto` on a torchtitan-style model read `round 1 (...): ...; TP=2: vocab-parallel-softmax at
    model` and `round 2: norm-weight-grad at norm` - neither the record nor the phase (helper hnew14)."""
    from tpdiag.cli.render import render_text

    def rnd(i, fixes, fd):
        return {"round": i, "fixes": fixes, "status": "divergent" if fd else "bitwise",
                "class": "rounding" if fd else None, "first_divergence": {"2": fd}}

    chain = [rnd(0, [], {"phase": "forward", "module": "layers.0.attention.wo", "kind": "out",
                         "cause": "row-parallel-reduction"}),
             rnd(1, ["tp-invariant-linear"], {"phase": "loss", "module": "model", "kind": "logprobs",
                                              "cause": "vocab-parallel-softmax"}),
             rnd(2, ["tp-invariant-linear", "invariant-vocab-softmax"],
                 {"phase": "backward", "module": "norm", "kind": "param_grad", "cause": "norm-weight-grad"}),
             rnd(3, ["tp-invariant-linear", "invariant-vocab-softmax", "invariant-norm-grad"], None)]
    text = render_text({"status": "divergent", "class": "rounding", "reference": 1, "reference_label": "1", "degrees": {},
                        "fix_chain": chain, "status_after_fixes": "bitwise"})
    assert "TP=2: row-parallel-reduction at forward: layers.0.attention.wo" in text, text
    assert "TP=2: vocab-parallel-softmax at loss: logprobs" in text, text
    assert "TP=2: norm-weight-grad at backward: norm (param_grad)" in text, text
