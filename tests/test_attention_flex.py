"""`--attention flex`: an engine or trainer loaded with attn_implementation="flex_attention" (torch's
flex_attention, compiled). Checked once by hand on the project's CPU (torch 2.13, transformers 5.24,
docs/rl.md): a float32 Qwen2 whose generate() ran flex over 4 prompts of one length is
`tp1-mb4-decode-none-flex` 32/32 bit for bit (`tp1-mb4-decode-none`, SDPA, 19/32), and
`tp1-mb4-prefill-none-flex` is the user's own flex forward bit for bit; each flex configuration
compiles for tens of seconds here, so the suite checks the switch itself: the configuration runs
transformers' flex_attention and puts the model's own back, its label round-trips, a model tpdiag
cannot switch has it unavailable, the advice names transformers' spelling, and compare refuses it
in one line (before: `--attention flex` was refused by rollout and compare alike, and a flex
engine had no configuration that could reproduce it)."""
import pytest

pytest.importorskip("transformers")


def _tiny():
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.rl_team import BASE

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen2", **BASE)).eval()


def test_flex_runs_transformers_flex_attention_and_puts_the_model_back():
    from tpdiag.base.configs import Config, parse
    from tpdiag.rollout.compute import Unavailable
    from tpdiag.runner import attention as attn

    assert attn.parse("auto,flex") == ("auto", "flex")
    model = _tiny()
    assert model.config._attn_implementation == "sdpa"
    with attn.attention(model, "flex", Unavailable):
        assert model.config._attn_implementation == "flex_attention"
        assert all(m.config._attn_implementation == "flex_attention" for m in model.modules()
                   if hasattr(m, "config") and hasattr(m.config, "_attn_implementation"))
    assert model.config._attn_implementation == "sdpa"
    c = Config(1, 4, "decode", attention="flex")
    assert c.rollout_name() == "tp1-mb4-decode-none-flex" and parse(c.rollout_name()) == c

    class Preset(__import__("torch").nn.Module):
        pass

    with pytest.raises(Unavailable, match="attention flex: only hf: models switch"):
        with attn.attention(Preset(), "flex", Unavailable):
            pass


def test_the_advice_names_transformers_spelling_and_compare_refuses_flex():
    from tests.conftest import run_cli
    from tpdiag.base.configs import Config
    from tpdiag.rollout.todo import _meaning

    ref, like = Config(1, 4, "decode"), Config(1, 4, "decode", attention="flex")
    words = _meaning("attention", "auto", "flex", ref, like, 4)
    assert 'attn_implementation="flex_attention"' in words, words
    r = run_cli("compare", "--tp", "1,2", "--attention", "flex")
    assert r.returncode == 2 and "--attention flex: not an axis of compare" in r.stderr, r.stderr
