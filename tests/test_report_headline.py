"""The report's verdict line for a bug behind a harmless reordering: the CLI's first line names the
bug, the report's read "BUG: TP=2 first differs from TP=1 at ... mlp.down ... (row-parallel-reduction)"
- the harmless first divergence, the bug only further down under Findings (helper hbug6). It names
where the wrong result is now, and the first divergence as the rounding it is."""
from tpdiag.reports.words import verdict


def _d(cls, findings):
    fd = {"cause": "row-parallel-reduction", "phase": "forward", "module": "layers.0.feed_forward.w2",
          "kind": "out", "step": 0, "max_abs": 1e-6}
    return {"status": "divergent", "class": cls, "first_divergence": fd, "findings": findings}


BUG = {"cause": "sharding-bug", "phase": "forward", "module": "layers.1.feed_forward.w2", "kind": "out",
       "step": 0, "max_abs": 0.5, "bound": 1e-6}


def test_a_bug_behind_a_reordering_is_the_headline():
    h = verdict("2", "1", _d("bug", [BUG]), lambda c, op: (None, False))["headline"]
    assert h.startswith("BUG: TP=2 computes a wrong result at the output of layers.1.feed_forward.w2"), h
    assert "layers.0.feed_forward.w2" in h and "rounding" in h, h


def test_rounding_and_a_bug_at_the_first_divergence_keep_their_headline():
    h = verdict("2", "1", _d("rounding", []), lambda c, op: (None, False))["headline"]
    assert h.startswith("Rounding: TP=2 first differs from TP=1 at"), h
    # a finding that follows another as grave is no root of its own
    first = {**BUG, "key": "a", "module": "layers.1.attention.wo"}
    h = verdict("2", "1", _d("bug", [first, {**BUG, "key": "b", "follows": "a"}]), lambda c, op: (None, False))["headline"]
    assert "layers.1.attention.wo" in h and "feed_forward" not in h.split(";")[0], h
    # ... and one that follows a rounding finding, or a record that is no finding, is (the gate judges it)
    for root in ({"key": "a", "cause": "router-flip"}, {"key": "z"}):
        h = verdict("2", "1", _d("bug", [root, {**BUG, "key": "b", "follows": "a"}]),
                    lambda c, op: (None, False))["headline"]
        assert h.startswith("BUG: TP=2 computes a wrong result at the output of layers.1.feed_forward.w2"), h


def test_the_report_names_where_a_confirmed_fix_moves_the_divergence_as_the_terminal_does():
    """The terminal read `first divergence moves to loss: logprobs (vocab-parallel-softmax)`, the report
    `moves to model (loss)` - another record name, no cause (helper hnew14, the README's tiny-llama run)."""
    from tpdiag.reports.words import action

    after = {"phase": "loss", "module": "model", "kind": "logprobs", "name": "logprobs", "step": 0,
             "cause": "vocab-parallel-softmax"}
    s = action("row-parallel-reduction", {"fix": "tp-invariant-linear", "verdict": "confirmed",
                                          "first_divergence_after": after}, "tp-invariant-linear", True)
    assert "moves to the logprobs of model in the loss pass of step 0 (vocab-parallel-softmax)." in s, s
    assert "model (loss)" not in s, s
