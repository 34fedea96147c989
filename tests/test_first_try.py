"""A new user's first `py:` target, refused before any world starts with a line that says what to
change (helper hnew14). Before: FUNC returning the model read `returned TinyLM, expected
tpdiag.Target` with no word on how; a vocab_size past the embedding launched every world, which
failed with `IndexError ... index out of range in self` at the user's embedding call."""
import os

import pytest

from conftest import run_cli

MODEL = os.path.join("tests", "models", "planted", "first_try.py")


@pytest.mark.parametrize("func,needles", [
    ("just_the_model", ["returned TinyLM (an nn.Module: return tpdiag.Target(model=..., plan=..., "
                        "vocab_size=...) around it"]),
    ("TinyLM", ["TinyLM is an nn.Module class; name a function that returns "
                "tpdiag.Target(model=TinyLM(...), plan=..., vocab_size=...)"]),
    ("tokenizer_vocab", ["Target.vocab_size is 1000 but the model's largest embedding, tok_embeddings, "
                         "has 128 rows", "set vocab_size to the model's vocabulary"]),
])
def test_a_first_try_is_refused_in_one_line_before_any_world(tmp_path, func, needles):
    out = tmp_path / "run"
    p = run_cli("compare", "--model", f"py:{MODEL}:{func}", "--tp", "1,2", "--out", str(out))
    assert p.returncode == 2, p.stderr + p.stdout
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
    for n in needles:
        assert n in p.stderr, p.stderr
    assert not out.exists()  # nothing launched, nothing written


def test_the_vocab_check_passes_a_correct_target():
    from tpdiag.models.precheck import check_vocab
    from tpdiag.models.spec import load_target, parse_spec

    t = load_target(parse_spec(f"py:{MODEL}:target"))
    check_vocab(t.model, t.vocab_size, "t")  # 128 rows for 128 tokens: no refusal
