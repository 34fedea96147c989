"""A py: Target whose trainer takes the tokens' logprobs in its own `Target.loss`
(tests/models/planted/rl_loss_logprob.py): `tpdiag rollout` took every configuration's logprobs
with tpdiag's own log-softmax, so a loss that shifts the labels twice, takes the log-softmax over
the sequence or divides by a temperature the engine did not sample at read `reproduced` /
`rounding, harmless` / `within NeMo RL's 1.05 for a healthy run` (exit 0). Now the user's loss runs
on a TP=1 configuration's rows with one generated token labelled (rollout/own_loss.py): -loss is
the trainer's own logprob bit for bit, judged against a float64 log-softmax of the same rows."""
import pytest
import torch

FILE = "tests/models/planted/rl_loss_logprob.py"
SPEC = f"py:{FILE}:"


def _user():
    from own_sampler import user_module

    return user_module(FILE, "rl_loss_logprob_user")


def _engine(name, path, temperature=1.0):
    """The team's sampler: its policy, one prompt per call through its KV cache, each sampled
    token's float32 log-softmax (raw, T = 1, unless told; tests/own_sampler.py)."""
    from own_sampler import sample

    return sample(FILE, name, path, temperature=temperature)


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    root = tmp_path_factory.mktemp("own_loss")
    return {"float32": _engine("logprob_ok", root / "f32.jsonl"), "bfloat16": _engine("logprob_ok_bf16", root / "bf16.jsonl"),
            "t0.7": _engine("logprob_ok", root / "t07.jsonl", temperature=0.7)}


def _rollout(path, name, **kw):
    from tpdiag.rollout.run import RolloutConfig, run_rollout

    kw.setdefault("fixes", ("none",))
    return run_rollout(RolloutConfig(file=path, model=SPEC + name, **kw))


def _trainer(name, path, dtype=torch.float32):
    """The user's own trainer step, as the team runs it: one sequence per forward, the labels the
    generated tokens (the prompt -100), token_logprobs as its loss and ratio take them."""
    from tpdiag.rollout.read import read_rollout

    mod = _user()
    torch.manual_seed(1234)
    model = getattr(mod, name)().model.eval()
    how = {"logprob_ok": "ok", "logprob_ok_bf16": "bf16"}.get(name, name)
    out = {}
    with torch.no_grad():
        for i, s in enumerate(read_rollout(path).sequences):
            ids = torch.tensor([s.input_ids])
            labels = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], 1)
            labels[:, :s.prompt_len - 1] = -100
            lp = mod.token_logprobs(model(ids), labels, how)[0]
            for j in range(s.prompt_len - 1, len(s.input_ids) - 1):
                # shift_twice's term for the label at j sits at j - 1 (its own shift)
                out[(i, j + 1)] = lp[j - 1 if how == "shift_twice" else j]
    return out


@pytest.mark.parametrize("name, modes, case", [("shift_twice", ("prefill", "decode"), "settings"),
                                               ("softmax_dim", ("prefill",), "none"),
                                               ("temp_scaled", ("decode",), "loss")])
def test_a_bug_in_the_users_loss_reads_bug_at_the_loss(engines, name, modes, case):
    s = _rollout(engines["float32"], name, micro_batch=(1,), modes=modes)
    own = s["own_loss"]
    assert own["rows_are_the_configurations"]  # the rows the loss read gave the configuration's logprobs bit for bit
    assert own["bug"] and own["ratio"] > 1e3 and own["beyond"] == own["tokens"] == 18, {k: own[k] for k in ("ratio", "beyond")}
    assert own["function"].startswith(f"{FILE}:") and own["function"].endswith("loss"), own["function"]
    assert any(n.startswith("BUG in Target.loss") for n in s["notes"]), s["notes"]
    todo = s["what_to_do"]
    assert todo["case"] == case, todo
    assert "fix your Target.loss" in todo["line"] and "healthy run" not in todo["line"], todo["line"]
    assert own["engine"]["token_mult_prob_error"] > 1.05 and own["engine"]["exact_tokens"] == 0, own["engine"]
    if name == "shift_twice":
        # -loss with one token labelled is the team's own per-token logprob bit for bit
        want = _trainer(name, engines["float32"])
        for o in own["checked"]:
            assert torch.equal(torch.tensor(o["own"], dtype=torch.float32), want[(o["seq"], o["position"])].float())


def test_the_correct_loss_gives_tpdiags_bits_and_the_axes_read_rounding(engines):
    s = _rollout(engines["float32"], "logprob_ok", micro_batch=(3, 1), modes=("prefill", "decode"))
    own = s["own_loss"]
    assert not own["bug"] and own["ratio"] <= 1 and own["same_bits"] == own["tokens"] == 18, own
    assert not any(n.startswith("BUG") for n in s["notes"]), s["notes"]
    todo = s["what_to_do"]
    assert todo["case"] == "settings" and "healthy run" in todo["line"], todo
    # the micro-batch and mode axes still read rounding (the engine is mb1 decode)
    meanings = {d["axis"]: d["meaning"] for d in todo["differs"]}
    assert "rounding" in meanings["mode"] and "micro_batch" in meanings and "rounding" in meanings["micro_batch"], meanings


def test_the_correct_bf16_loss_reads_rounding_not_tpdiags_bits(engines):
    s = _rollout(engines["bfloat16"], "logprob_ok_bf16", dtype="bfloat16", micro_batch=(1,), modes=("prefill",))
    own = s["own_loss"]
    assert not own["bug"] and 0 < own["ratio"] <= 1, own["ratio"]
    # a bf16 log-softmax: other bits than tpdiag's float32 one, and the user's own bit for bit
    assert own["same_bits"] < own["tokens"] and own["max_abs_tpdiag"] > 1e-3, own
    want = _trainer("logprob_ok_bf16", engines["bfloat16"])
    for o in own["checked"]:
        assert torch.equal(torch.tensor(o["own"], dtype=torch.float32), want[(o["seq"], o["position"])].float())
    todo = s["what_to_do"]
    assert todo["case"] == "nothing" and "rounding of the same log-softmax" in todo["line"], todo["line"]
    assert not any(n.startswith("BUG") for n in s["notes"]), s["notes"]


def test_the_temperature_the_run_names_is_the_references(engines):
    """temp_scaled's division by 0.7 is the bug against an engine at T = 1 (above) and the right
    function against an engine that sampled and reported at 0.7, named with --trainer-temperature."""
    from tpdiag.runner.recipe import Recipe

    s = _rollout(engines["t0.7"], "temp_scaled", micro_batch=(1,), modes=("prefill",), recipe=Recipe(temperature=0.7))
    own = s["own_loss"]
    assert own["temperature"] == 0.7 and not own["bug"] and own["ratio"] <= 1, own
    assert not any(n.startswith("BUG") for n in s["notes"]), s["notes"]
    s = _rollout(engines["t0.7"], "logprob_ok", micro_batch=(1,), modes=("prefill",), recipe=Recipe(temperature=0.7))
    assert s["own_loss"]["bug"], "a loss at T = 1 against the 0.7 the run names"


def test_an_hf_or_preset_model_has_no_loss_of_its_own():
    from tpdiag.rollout import own_loss

    class T:
        loss = None
    assert own_loss.applies(T()) is False
