"""A new RL team's trial (tests/rl_user25.py: their own harness for a tiny Gemma saved in bf16,
`from_pretrained(torch_dtype=bfloat16, attn_implementation="sdpa", use_cache=True)`, generate() at
temperature 0.7 and top_p 0.9 over left-padded chat prompts, a trainer that divides its bf16 logits
by T in place).

- What tpdiag claims holds bit for bit, checked against the team's own numbers: generate()'s raw
  logprobs and its logprobs at T are `tp1-mb4-decode-none`'s; the trainer's own logprob function is
  `tp1-mb4-prefill-none` under `--trainer-temperature 0.7 --temperature-in model`, and not under the
  float32 division.
- An engine reporting raw logprobs (vLLM's default) to a trainer dividing by T: before, the run read
  `no sign of processing` and advised running without --trainer-temperature, the 0.69-nat gap
  unnamed; now a temperature note names the mismatch as a bug and what to do leads with it. An
  engine at the trainer's own T, divided in bf16 by the trainer: before, what to do said to run
  without --trainer-temperature (which the engine's T then moves by 0.69 nats) and to ask for raw
  logprobs; now it names --trainer-temperature 0.7 alone.
- The planted trainer bug: the py: target whose loss lost the division by T reads `BUG in
  Target.loss`; the correct one is tpdiag's bits."""
import pytest
import torch

pytest.importorskip("transformers")

import rl_user25 as user  # noqa: E402


@pytest.fixture(scope="module")
def team(tmp_path_factory):
    d = tmp_path_factory.mktemp("team")
    path = user.make_checkpoint(d / "model")
    model = user.load_policy(path)
    out, ids, mask = user.generate(model)
    files = {rep: user.write_jsonl(user.engine_rows(out, ids, mask, rep), d / f"{rep}.jsonl")
             for rep in ("raw", "tempered")}
    return path, model, files


def _run(team, rep, modes=("decode", "prefill"), model=None, **recipe):
    from tpdiag.rollout.run import RolloutConfig, run_rollout
    from tpdiag.runner.recipe import Recipe

    path, _, files = team
    got = {}
    rc = RolloutConfig(file=files[rep], model=model or "hf:" + path, dtype="bfloat16", micro_batch=(4,),
                       modes=modes, fixes=("none",), top=0, recipe=Recipe(**recipe) if recipe else None)
    return run_rollout(rc, on_logprobs=got.update), got


def _rows(team, rep):
    import json

    with open(team[2][rep]) as f:
        return [json.loads(line) for line in f]


def _exact(rows, got):
    return sum(int(torch.equal(torch.tensor(r["logprobs"], dtype=torch.float32), got[i][r["prompt_len"] - 1:]))
               for i, r in enumerate(rows))


def test_the_engine_and_the_trainer_are_reproduced_bit_for_bit(team):
    s, got = _run(team, "raw")
    assert s["closest"]["reproduced"] and _exact(_rows(team, "raw"), got["tp1-mb4-decode-none"]) == 4
    rows = _rows(team, "tempered")
    s, got = _run(team, "tempered", temperature=user.TEMPERATURE)
    assert s["closest"]["reproduced"] and _exact(rows, got["tp1-mb4-decode-none"]) == 4
    assert s.get("temperature") is None  # reproduced: nothing to say about the temperature
    # the trainer's own function: bf16 logits divided by T in place, float32 log-softmax
    mine = user.trainer_logprobs(team[1], rows)
    for div, want in (("model", True), ("float32", False)):
        _, got = _run(team, "tempered", modes=("prefill",), temperature=user.TEMPERATURE, divide_in=div)
        pre = got["tp1-mb4-prefill-none"]
        assert [torch.equal(mine[i], pre[i][r["prompt_len"] - 1:]) for i, r in enumerate(rows)] == [want] * 4, div


def test_a_raw_engine_against_a_trainer_at_its_temperature_is_a_named_mismatch(team):
    s, _ = _run(team, "raw", modes=("prefill",), temperature=user.TEMPERATURE)
    line = s["what_to_do"]["line"]
    assert "First make the engine's and the trainer's temperatures one" in line, line
    assert "the gap is the bug named above, not rounding" in line, line
    assert any(n.startswith("temperature mismatch: the engine's logprobs are raw") for n in s["notes"])
    t = s["temperature"]
    assert t["bug"] and t["engine"] == 1.0 and t["trainer"] == user.TEMPERATURE, t
    assert t["trainer_error"] > 0.3 and t["engine_error"] * 10 < t["trainer_error"], t
    # control: the engine at the trainer's temperature, the trainer dividing in bf16 - no bug, and the
    # way to the engine's function keeps the temperature
    s, _ = _run(team, "tempered", modes=("prefill",), temperature=user.TEMPERATURE, divide_in="model")
    line = s["what_to_do"]["line"]
    assert f"First run with --trainer-temperature {user.TEMPERATURE:g} alone" in line, line
    assert "ask the engine for raw logprobs" not in line and "bug named above" not in line, line
    t = s["temperature"]
    assert t is not None and not t["bug"] and t["engine"] == user.TEMPERATURE, t
    # the processed line no longer proposes the --trainer-temperature the run already gives
    assert s["processed"]["explanation"].endswith(f"this run's trainer does (--trainer-temperature {user.TEMPERATURE:g})")
    # which the command named does: the engine's function at its temperature reproduces the decode
    s, _ = _run(team, "tempered", modes=("decode",), temperature=user.TEMPERATURE)
    assert s["closest"]["reproduced"], s["closest"]


def test_the_trainer_that_lost_its_temperature_is_a_bug_in_its_loss(team, monkeypatch):
    monkeypatch.setenv("RL_USER25_DIR", team[0])
    spec = "py:" + user.__file__ + ":"
    s, _ = _run(team, "tempered", modes=("prefill",), model=spec + "policy_forgets_temperature",
                temperature=user.TEMPERATURE, divide_in="model")
    own = s["own_loss"]
    assert own["bug"], own
    assert "BUG in Target.loss" in own["line"] and "rl_user25.py" in own["line"], own["line"]
    assert s["what_to_do"]["line"].startswith("nothing tried reproduces the engine") and \
        "First fix your Target.loss" in s["what_to_do"]["line"]
    # control: the trainer as written is tpdiag's bits
    s, _ = _run(team, "tempered", modes=("prefill",), model=spec + "policy",
                temperature=user.TEMPERATURE, divide_in="model")
    assert not s["own_loss"]["bug"] and "bit for bit" in s["own_loss"]["line"], s["own_loss"]


def test_a_bf16_py_model_recast_to_float32_is_said(team, monkeypatch, tmp_path):
    """The team's py: trainer builds its model in bf16 (from_pretrained(torch_dtype=bfloat16)); under the
    default --dtype float32 tpdiag casts it to float32. Before, nothing said so: compare's verdict and
    rollout's numbers were a float32 model's, not the team's."""
    import json

    from conftest import run_cli

    monkeypatch.setenv("RL_USER25_DIR", team[0])
    spec = "py:" + user.__file__ + ":policy"
    want = "your py: model's parameters are bfloat16 as FUNC builds them (20 of 20) and this run computes in float32"
    from tpdiag.rollout.run import RolloutConfig, run_rollout

    for dtype, said in (("float32", True), ("bfloat16", False)):
        s = run_rollout(RolloutConfig(file=team[2]["raw"], model=spec, dtype=dtype, micro_batch=(4,),
                                      modes=("prefill",), fixes=("none",), top=0))
        assert any(n.startswith(want) for n in s["notes"]) == said, (dtype, s["notes"])
    out = tmp_path / "run"
    r = run_cli("compare", "--model", spec, "--tp", "1,1", "--forward-only", "--out", out,
                env={"RL_USER25_DIR": team[0]})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "note: " + want in r.stdout, r.stdout
    with open(out / "summary.json") as f:
        assert json.load(f)["checkpoint_dtype"]["built"] == "bfloat16"


def test_the_right_trainer_run_without_its_temperature_is_not_called_a_bug(team, monkeypatch):
    """The team's correct trainer (its loss divides by the T=0.7 the engine sampled and reported at) run
    without --trainer-temperature: before, `BUG in Target.loss ... fix the loss` though its own logprobs
    were 1.005 from the engine where tpdiag's T=1 numbers were 2.15; now the loss's temperature is found
    (every token within rounding of log_softmax(logits / 0.7)) and the run is told to name it."""
    monkeypatch.setenv("RL_USER25_DIR", team[0])
    spec = "py:" + user.__file__ + ":"
    s, _ = _run(team, "tempered", modes=("prefill",), model=spec + "policy")
    own = s["own_loss"]
    assert not own["bug"], own["line"]
    assert own["temperature_fit"]["temperature"] == user.TEMPERATURE and own["temperature_fit"]["engine"], own
    assert own["engine"]["token_mult_prob_error"] < 1.01 < own["tpdiag"]["token_mult_prob_error"], own
    line = s["what_to_do"]["line"]
    assert f"First run again with --trainer-temperature {user.TEMPERATURE:g}" in line and "BUG" not in line, line
    # control: the loss that lost its division, against the engine at T named on the command line, stays a
    # bug - and its line names the temperature it computes at (1), which is not the engine's
    s, _ = _run(team, "tempered", modes=("prefill",), model=spec + "policy_forgets_temperature",
                temperature=user.TEMPERATURE, divide_in="model")
    own = s["own_loss"]
    assert own["bug"] and own["temperature_fit"]["temperature"] == 1.0 and not own["temperature_fit"]["engine"], own
    assert "log_softmax(logits / 1) within rounding at every token" in own["line"], own["line"]


def test_a_trainer_dump_without_the_shift_is_named_though_the_policy_repeats_itself(team, tmp_path):
    """The trainer's dump before its shift fix (logits gathered at the input_ids: each token's logprob
    read from the row after the one that predicts it). This policy repeats tokens (`66 66 66 ...`),
    where the next row's logprob of the same token is the aligned one's: the median gap was 0.02 nats,
    under the misalignment check's floor, and the run read `not reproduced` with attention and
    static-cache advice while 40% of tokens were 1-5 nats off. Now the tokens the aligned logprob
    misses are held against each neighbour."""
    rows = _rows(team, "raw")
    path, model, files = team
    files = {**files, "dump": user.write_jsonl(user.trainer_dump(model, rows, shifted=False), tmp_path / "d.jsonl"),
             "fixed": user.write_jsonl(user.trainer_dump(model, rows), tmp_path / "f.jsonl")}
    s, _ = _run((path, model, files), "dump", modes=("prefill",))
    assert s["shifted"] and s["shifted"]["shift"] == [1, 0], s["shifted"]
    assert s["shifted"]["aligned_median_abs"] < 0.05 < s["shifted"]["aligned_mean_abs"], s["shifted"]
    assert "First fix which token each logprob is taken for" in s["what_to_do"]["line"], s["what_to_do"]["line"]
    # control: the fixed dump is the trainer's prefill bit for bit, nothing misaligned
    s, _ = _run((path, model, files), "fixed", modes=("prefill",))
    assert s["closest"]["reproduced"] and s["shifted"] is None, s["closest"]
