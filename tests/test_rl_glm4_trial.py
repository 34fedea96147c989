"""A new RL team's trial (tests/rl_glm4_team.py: a tiny GLM-4 policy, generate() as the engine,
the trainer's dumps; tests/models/user_glm4_rl.py: the trainer's own TP plan).

- The TP plan copied from Llama onto GLM-4's fused gate_up_proj (ColwiseParallel: rank 0 multiplies
  gate columns by gate columns) made TP=2's logprobs 4.19 nats (max) from TP=1's; `tpdiag rollout
  --tp 1,2` printed the TP=2 rows (token_mult_prob_error 6.59) and then `what to do: nothing to do`
  (with --fix none, no note at all). The TP gap is now judged against the rounding the run itself
  shows at TP=1 (rollout/tp_gap.py): BUG, and `what to do` leads with it. transformers' own plan
  (the fused output gathered) is the correct twin: no TP note, nothing led with.
- A trainer that takes the log-softmax in bf16 wrote numbers that are all bf16: it read `not
  reproduced ... the gap is not shown to be rounding` and advised attention and static-cache
  settings, never `--logprob model-dtype`. It is now named (rollout/low_precision.py) and judged
  rounding; a bf16-stored dump of a trainer that ran the padding unmasked (a bug) is named bf16 but
  not rounding, and a float32 dump is not named.
"""
import os

import pytest
import torch

from conftest import ROOT

pytest.importorskip("transformers", minversion="5")

USER = os.path.join(ROOT, "tests", "models", "user_glm4_rl.py")


@pytest.fixture(scope="module")
def team(tmp_path_factory):
    from rl_glm4_team import make

    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        d = tmp_path_factory.mktemp(f"glm4_{str(dtype).split('.')[-1]}")
        out[dtype] = (d, make(d, dtype))
    return out


def _rollout(file, model, dtype="float32", **kw):
    from tpdiag.rollout.run import RolloutConfig, run_rollout

    kw = {"micro_batch": (4,), "modes": ("prefill",), "fixes": ("none",), **kw}
    return run_rollout(RolloutConfig(file=file, model=model, dtype=dtype, **kw))


@pytest.mark.parametrize("target", ["fused_colwise", "fused_gathered"])
def test_a_tp_plan_that_is_another_function_is_a_bug_and_leads(team, target, monkeypatch):
    d, files = team[torch.float32]
    monkeypatch.setenv("USER_GLM4_DIR", str(d / "model"))  # read by the user's file, in every rank too
    # the trainer's own TP=1 dump: its configuration reproduces it, so what_to_do read "nothing to do"
    s = _rollout(files["correct"], f"py:{USER}:{target}", tp=(1, 2), fixes=("none", "all"))
    gaps, line = s.get("tp_gap", {}), s["what_to_do"]["line"]
    tp2 = s["configurations"]["tp2-mb4-prefill-none"]
    assert "metrics" in tp2, tp2.get("reason")  # the TP=2 world ran (its ranks see USER_GLM4_DIR: test_rank_env.py)
    stock = tp2["metrics"]
    if target == "fused_colwise":
        assert stock["token_mult_prob_error"] > 2, stock  # the TP=2 rows are far off
        assert line.startswith("first: fix the trainer's TP=2 path"), line  # it read "nothing to do: ..."
        assert gaps["tp2-mb4-prefill-none"]["bug"] is True and gaps["tp2-mb4-prefill-none"]["gap"] > 0.1, gaps
        assert gaps["tp2-mb4-prefill-none"]["ratio"] > 1000, gaps
        assert any("TP=2 path computes another function" in n for n in s["notes"]), s["notes"]
        # the hedged under-the-fixes note is not said beside the judged one
        assert not any("a reordering no fix covers" in n for n in s["notes"]), s["notes"]
        assert "; at TP=1 nothing to do" in line, line
    else:
        assert stock["token_mult_prob_error"] < 1.0001, stock
        assert not any(v["bug"] for v in gaps.values()), gaps
        assert not any("TP=2 path" in n for n in s["notes"]) and "TP=2 path" not in line, (s["notes"], line)
        # under the fixes TP=2 is TP=1's bits: the correct plan
        assert s["tp_invariance"]["tp2-mb4-prefill-all"]["same_bits"], s["tp_invariance"]


def test_a_bf16_logprob_dump_is_named_and_judged_rounding(team):
    d, files = team[torch.bfloat16]
    model = "hf:" + str(d / "model")
    s = _rollout(files["bf16_logprob"], model, "bfloat16")
    line = s["what_to_do"]["line"]
    assert "not shown to be rounding" not in line, line  # it read so, and advised attention settings
    low = s.get("low_precision")
    assert not s["closest"]["reproduced"]
    assert low and low["dtype"] == "bfloat16" and low["rounding"] is True and low["within"] == low["tokens"] == 32, low
    assert "the bfloat16 note above explains it" in line and "--logprob model-dtype" in line, line
    # what the note proposes reproduces it bit for bit
    from tpdiag.runner.recipe import parse

    s = _rollout(files["bf16_logprob"], model, "bfloat16", recipe=parse("model-dtype"))
    assert s["closest"]["reproduced"] and s["low_precision"] is None, s["closest"]


def test_a_bf16_dump_of_a_padding_bug_is_not_called_rounding(team):
    d, files = team[torch.bfloat16]
    s = _rollout(files["bf16_unmasked"], "hf:" + str(d / "model"), "bfloat16")
    low = s["low_precision"]
    assert low and low["dtype"] == "bfloat16" and low["rounding"] is False and low["within"] < low["tokens"], low
    assert "bfloat16 note above explains it" not in s["what_to_do"]["line"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float32_dumps_are_not_named_bf16(team, dtype):
    d, files = team[dtype]
    name = "float32" if dtype == torch.float32 else "bfloat16"
    s = _rollout(files["correct"], "hf:" + str(d / "model"), name)
    assert s["closest"]["reproduced"] and s["low_precision"] is None, s["closest"]
    s = _rollout(files["engine"], "hf:" + str(d / "model"), name, modes=("prefill", "decode"))
    assert s["low_precision"] is None and "tp_gap" in s and s["tp_gap"] == {}, s["low_precision"]


def test_an_engine_at_its_temperature_names_the_trainer_temperature(team):
    """A trainer that forgets the sampling temperature: the processed line names T and now says what the
    trainer must do (--trainer-temperature T); with it, the engine's decode is reproduced bit for bit."""
    from tpdiag.runner.recipe import parse

    d, files = team[torch.float32]
    model = "hf:" + str(d / "model")
    s = _rollout(files["engine_at_T"], model)
    p = s["processed"]
    assert p["detected"] and p["kind"] == "temperature", p
    assert "--trainer-temperature 0.8" in p["explanation"] and "a bug in its loss" in p["explanation"], p
    s = _rollout(files["engine_at_T"], model, modes=("prefill", "decode"), recipe=parse("log-softmax", 0.8))
    assert s["closest"]["reproduced"] and s["closest"]["configurations"] == ["tp1-mb4-decode-none"], s["closest"]


def test_a_bf16_engines_processed_scores_read_on_prefill_rows_say_so(team):
    """generate()'s output_scores (T=0.8, top_k=20) of the bf16 policy: read on the prefill's rows (not the
    decoding engine's bits) no temperature and filter fits, and the line said only "a penalty ... or another
    model"; it now says whose rows it read and that --mode decode,prefill reads the engine's - where the same
    file reads temperature+filter at T=0.8."""
    d, files = team[torch.bfloat16]
    model = "hf:" + str(d / "model")
    s = _rollout(files["engine_scores"], model, "bfloat16", modes=("prefill", "decode"))
    p = s["processed"]
    assert p["kind"] == "systematic", p
    assert "read on tp1-mb4-prefill-none's logits rows" in p["explanation"], p["explanation"]
    s = _rollout(files["engine_scores"], model, "bfloat16", modes=("decode", "prefill"))
    p = s["processed"]
    assert p["kind"] == "temperature+filter" and "0.8" in p["explanation"], p
    assert "read on" not in p["explanation"], p["explanation"]
