"""The verdict line of a non-finite run says which side holds the first NaN/Inf (cli/render._bug_words):
at 00909fb tests/models/planted/tied_vocab.py:tied_ok in float16 (tpdiag's own AdamW wrote NaN at the
reference and TP=2 alike) read "NON-FINITE ... at TP=2 optimizer: vocab (param weight), infx beyond
rounding" - as if TP=2 alone went non-finite - and rendering the summary back from summary.json (its
ratio written as the string "inf") raised a TypeError. Constructed summaries: the words only."""
import pytest

from tpdiag.cli.render import render_text

FIRST = {"phase": "optimizer", "module": "vocab", "kind": "param", "name": "weight", "step": 0,
         "key": "s0/optimizer/vocab/param#0/weight", "cause": "non-finite", "bound_ratio": "inf"}


def _summary(side):
    return {"status": "divergent", "class": "non-finite", "reference": "1", "reference_label": "1", "degrees": {"2": {
        "status": "divergent", "class": "non-finite", "first_divergence": dict(FIRST),
        "nonfinite": {"records": 3, "first": dict(FIRST, value="nan", side=side)}}}}


@pytest.mark.parametrize("side,words", [("both", "nan at the reference and TP=2"),
                                        ("degree", "nan at TP=2 only"),
                                        ("reference", "nan at the reference only")])
def test_the_verdict_line_says_which_side_went_non_finite(side, words):
    head = render_text(_summary(side)).splitlines()[0]
    assert head.startswith("verdict: divergent, NON-FINITE"), head
    assert f"at TP=2 optimizer: vocab (param weight) - {words}" in head and "infx" not in head, head
