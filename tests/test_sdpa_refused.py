"""`--attention auto,sdpa` (or any SDPA backend) for an hf: model whose own attention is not SDPA
(Gemma2: transformers has no SDPA path for it, from_config picks eager): every world raised the
refusal from inside its step (runner/step.py), after the reference had run - the verdict read
`inconclusive` with a table row "rank 0 raised BadInput: ...", and a run directory was left
behind. It is refused before any world starts now, in one line (exit 2), nothing written; a model
whose attention is SDPA is not refused."""
import pytest

from tests.conftest import run_cli

pytest.importorskip("transformers")


def _write(tmp_path, model_type: str) -> str:
    from transformers import AutoConfig

    path = str(tmp_path / model_type)
    cfg = AutoConfig.for_model(model_type, vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                               num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=32)
    cfg.architectures = [{"gemma2": "Gemma2ForCausalLM", "llama": "LlamaForCausalLM"}[model_type]]
    cfg.save_pretrained(path)
    return path


def test_an_sdpa_choice_for_a_model_without_sdpa_is_refused_before_any_world(tmp_path):
    path = _write(tmp_path, "gemma2")
    out = tmp_path / "run"
    p = run_cli("compare", "--model", "hf:" + path, "--tp", "1", "--attention", "auto,sdpa", "--out", str(out))
    assert p.returncode == 2, p.stdout + p.stderr
    lines = [x for x in (p.stdout + p.stderr).splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].lower().startswith("error: "), lines
    want = "--attention sdpa: Gemma2ForCausalLM runs 'eager' attention, not SDPA"
    assert lines[0][len("error: "):].startswith(want), lines
    assert not out.exists()  # no world ran (the reference used to, then every other world failed)


def test_the_attention_a_model_runs_is_read_before_launch(tmp_path):
    from tpdiag.models.hf import attention_of

    assert attention_of(_write(tmp_path, "gemma2")) == "eager"
    assert attention_of(_write(tmp_path, "llama")) == "sdpa"  # not refused: checks._check_sdpa passes it
