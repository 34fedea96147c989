"""generate() of a model that builds its own cache: transformers' MiniMax (linear-attention layers
beside full-attention ones) refuses the DynamicCache generate() gives other models
(`_supports_default_dynamic_cache()` is False: generate() passes no cache and the model's forward
makes a MiniMaxCache). tpdiag's decode built a DynamicCache for every hf: model, so the rollout's
decode configurations failed ('MiniMax uses cache of its own and is not compatible with `cache` of
type DynamicCache') and only the prefill ran - 'not reproduced' for an engine that was tpdiag's
own decode. A tiny MiniMax saved in bf16, loaded with from_pretrained, one generate() call with an
RL team's sampling: its raw logprobs are tpdiag's decode at the engine's batch bit for bit.
"""
import pytest
import torch

from test_rollout_rl_team import SAMPLE, engine, rollout, save_bf16

pytest.importorskip("transformers", minversion="5")

MINIMAX = dict(num_local_experts=4, num_experts_per_tok=2, layer_types=["linear_attention", "full_attention"])


def test_minimax_generate_is_reproduced_by_decode_with_the_models_own_cache(tmp_path, monkeypatch):
    path = save_bf16("minimax", tmp_path / "minimax", **MINIMAX)
    files, model = engine(path, **SAMPLE)
    assert not model._supports_default_dynamic_cache()  # the case: generate() gives it no cache
    rows = files["raw"]
    n = sum(len(x["logprobs"]) for x in rows)
    s, _ = rollout(tmp_path, rows, path, modes=("decode", "prefill"))
    m = s["configurations"]["tp1-mb8-decode-none"]
    assert m["status"] == "ok", m
    assert m["metrics"]["exact_tokens"] == m["metrics"]["tokens"] == n
    assert s["closest"]["reproduced"] is True and s["closest"]["configurations"] == ["tp1-mb8-decode-none"]
    # the comparison can fail: the prefill is not the engine's decode
    assert s["configurations"]["tp1-mb8-prefill-none"]["metrics"]["exact_tokens"] < n
    # negative control: a DynamicCache handed to it, as tpdiag did for every hf: model
    from transformers import DynamicCache

    from tpdiag.runner import decode

    monkeypatch.setattr(decode, "_new_cache", lambda model, config: DynamicCache(config=config))
    from tpdiag.errors import BadInput

    with pytest.raises(BadInput, match="tp1-mb8-decode-none: ValueError: MiniMax uses cache of its own"):
        rollout(tmp_path, rows, path, modes=("decode",))
