"""An RL team whose trainer takes its logprobs another way than tpdiag's default float32
log_softmax-then-gather: `x.gather(ids) - x.logsumexp(-1)` (TRL's selective_log_softmax and verl's
logprobs_from_logits_v2 for float32 logits, OpenRLHF), a log_softmax in bf16 row by row (their bf16
branch), logits divided by the temperature in bf16 before the float cast (TRL's GRPO, verl) or after
it. `tpdiag rollout --logprob/--trainer-temperature/--temperature-in` names the recipe, and tpdiag's
prefill is then the user's own hand-computed recipe bit for bit (torch.equal, every position of
every sequence). Before, tpdiag had one recipe: its prefill had the logsumexp trainer's bits for 3
of 8 sequences, the bf16 ones for none (the controls below). The verdict follows the recipe: a
generate() engine's raw logprobs are reproduced by the default recipe and not by logsumexp; an
engine's logprobs at T are reproduced by a trainer dividing float32 logits and not by one dividing
bf16 logits."""
import pytest
import torch

pytest.importorskip("transformers")

from tests.rl_team import engine, right_padded, rollout, same_rows, save_bf16, trainer_logits  # noqa: E402

T = 0.7


def _user(model, rows):
    """The user's trainer: one forward of the right-padded batch, then each recipe as written."""
    ids, _ = right_padded(rows)
    logits = trainer_logits(model, rows)
    assert logits.dtype == torch.bfloat16
    lab = torch.cat([ids[:, 1:], ids[:, :1]], 1)

    def selective_fp32(x):  # TRL's selective_log_softmax / verl's v2 for float32 logits
        picked = torch.gather(x, -1, lab.unsqueeze(-1)).squeeze(-1)
        return picked - torch.stack([torch.logsumexp(row, dim=-1) for row in x])

    def selective_bf16(x):  # their branch for bf16 logits: a log_softmax per row, in bf16
        return torch.stack([row.log_softmax(-1).gather(-1, r.unsqueeze(-1)).squeeze(-1)
                            for row, r in zip(x, lab)]).float()

    with torch.no_grad():
        return {
            ("log-softmax", 1.0, "float32"): logits.float().log_softmax(-1).gather(-1, lab[..., None])[..., 0],
            ("logsumexp", 1.0, "float32"): selective_fp32(logits.float()),
            ("model-dtype", 1.0, "float32"): selective_bf16(logits),
            ("log-softmax", T, "model"): (logits / T).float().log_softmax(-1).gather(-1, lab[..., None])[..., 0],
            ("logsumexp", T, "float32"): selective_fp32(logits.float() / T),
            ("model-dtype", T, "model"): selective_bf16(logits / T),
        }


@pytest.fixture(scope="module")
def team(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("recipe")
    path = save_bf16("qwen2", tmp / "q")
    files, model = engine(path, temperature=T, top_k=0)
    return tmp, path, files, _user(model, files["raw"])


def test_each_recipe_is_the_users_own_bits(team):
    from tpdiag.runner.recipe import parse

    tmp, path, files, user = team
    rows = files["raw"]
    for key, want in user.items():
        _, got = rollout(tmp, rows, path, modes=("prefill",), recipe=parse(*key))
        pre = got["tp1-mb8-prefill-none"]
        assert same_rows(want, rows, pre) == len(rows), key
        # each recipe is bits of its own: no other recipe's on every sequence
        assert all(same_rows(other, rows, pre) < len(rows) for k, other in user.items() if k != key), key
    # the control: without a recipe (tpdiag before) the prefill is not these trainers' bits
    _, got = rollout(tmp, rows, path, modes=("prefill",))
    pre = got["tp1-mb8-prefill-none"]
    assert same_rows(user[("log-softmax", 1.0, "float32")], rows, pre) == len(rows)
    assert same_rows(user[("logsumexp", 1.0, "float32")], rows, pre) < len(rows)
    assert same_rows(user[("model-dtype", T, "model")], rows, pre) == 0


def test_the_verdict_follows_the_recipe(team):
    from tpdiag.runner.recipe import parse

    tmp, path, files, _ = team
    raw, scores = files["raw"], files["scores"]
    s, _ = rollout(tmp, raw, path, modes=("decode",))
    assert s["closest"]["reproduced"] and s["logprob_recipe"]["name"] == "log-softmax"
    s, _ = rollout(tmp, raw, path, modes=("decode",), recipe=parse("logsumexp"))
    m = s["configurations"]["tp1-mb8-decode-none"]["metrics"]
    assert not s["closest"]["reproduced"] and 0 < m["exact_tokens"] < m["tokens"], m
    assert s["logprob_recipe"]["formula"] == "x = logits.float(); x.gather(-1, ids) - x.logsumexp(-1)"
    assert any("run without --logprob/--trainer-temperature" in n for n in s["notes"]), s["notes"]
    # the engine's logprobs at T (output_scores, no filter): a trainer dividing float32 logits by T
    s, _ = rollout(tmp, scores, path, modes=("decode",), recipe=parse("log-softmax", T, "float32"))
    m = s["configurations"]["tp1-mb8-decode-none"]["metrics"]
    assert s["closest"]["reproduced"] and m["exact_tokens"] == m["tokens"], m
    # the engine did process them: reproduced by the trainer's division, not read as raw logits' bits
    assert s["processed"]["detected"] is False and "divided by its temperature 0.7" in s["processed"]["explanation"]
    s, _ = rollout(tmp, scores, path, modes=("decode",), recipe=parse("log-softmax", T, "model"))
    assert not s["closest"]["reproduced"]
    # the processed check reads the engine against the model's own logits, not the trainer's quotient
    assert s["processed"]["kind"] == "temperature" and s["processed"]["temperature_fit"] == T, s["processed"]
    s, _ = rollout(tmp, raw, path, modes=("decode",), recipe=parse("log-softmax", T, "model"))
    assert s["processed"]["detected"] is False, s["processed"]


@pytest.mark.parametrize("args,words", [
    (("softmax",), "--logprob 'softmax': expected one of log-softmax, logsumexp, model-dtype"),
    (("model-dtype", T, "float32"), "add --temperature-in model"),
    (("log-softmax", 0.0), "--trainer-temperature 0.0: must be a positive number"),
    (("log-softmax", T, "bf16"), "--temperature-in 'bf16': expected float32"),
])
def test_a_recipe_that_is_no_recipe_is_one_line(args, words):
    from tpdiag.errors import BadInput
    from tpdiag.runner.recipe import parse

    with pytest.raises(BadInput, match=None) as e:
        parse(*args)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_a_trainer_temperature_beside_samplings_is_refused(team):
    from tpdiag.errors import BadInput
    from tpdiag.runner.recipe import parse

    tmp, path, files, _ = team
    with pytest.raises(BadInput, match="name the temperature once"):
        rollout(tmp, files["scores"], path, modes=("decode",), recipe=parse("log-softmax", T),
                sampling=(("temperature", T), ("top_k", 0)))


def test_a_tp2_world_takes_the_recipe(team):
    """The recipe travels to the TP > 1 worlds: under --fix all TP=2's logprobs are TP=1's bits
    (the log-softmax of bf16 logits divided by T in bf16; a world that took tpdiag's default would
    not divide at all), and stock TP=1 is the user's own recipe."""
    from tpdiag.runner.recipe import parse

    tmp, path, files, user = team
    rows = files["raw"]
    key = ("log-softmax", T, "model")
    s, got = rollout(tmp, rows, path, modes=("prefill",), tp=(1, 2), fixes=("none", "all"), recipe=parse(*key))
    assert s["tp_invariance"]["tp2-mb8-prefill-all"]["same_bits"], s["tp_invariance"]
    assert all(torch.equal(got["tp2-mb8-prefill-all"][i], got["tp1-mb8-prefill-all"][i]) for i in range(len(rows)))
    assert same_rows(user[key], rows, got["tp1-mb8-prefill-none"]) == len(rows)
