"""A py: Target whose trainer takes the tokens' logprobs in its own `Target.loss`
(tests/models/planted/rl_loss_logprob.py): `tpdiag rollout` took every configuration's logprobs
with tpdiag's own log-softmax, so a loss that shifts the labels twice, takes the log-softmax over
the sequence or divides by a temperature the engine did not sample at read `reproduced` /
`rounding, harmless` / `within NeMo RL's 1.05 for a healthy run` (exit 0). Now the user's loss runs
on a TP=1 configuration's rows with one generated token labelled (rollout/own_loss.py): -loss is
the trainer's own logprob bit for bit, judged against a float64 log-softmax of the same rows. A loss
that adds a z-loss or an entropy bonus (tests/models/planted/rl_zloss.py) read BUG there too; now a
token beyond its bound is labelled otherwise, and a term no label moves is the loss's, not the
logprob's (rollout/label_free.py)."""
import pytest
import torch

FILE = "tests/models/planted/rl_loss_logprob.py"


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


def _rollout(path, name, file=FILE, **kw):
    from tpdiag.rollout.run import RolloutConfig, run_rollout

    kw.setdefault("fixes", ("none",))
    return run_rollout(RolloutConfig(file=path, model=f"py:{file}:{name}", **kw))


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
    # labelled otherwise, the offset moves: not a term of the loss that no label moves (a z-loss)
    assert own["label_free"] == 0 and all(not o["relabel"]["label_free"] for o in own["checked"]), own["checked"]
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


ZFILE = "tests/models/planted/rl_zloss.py"


def _rows(seq):
    """The policy's float32 logits rows of one sequence, as the loss reads them (seed 1234, as tpdiag
    builds it): the rows that predict a token, the last position's left out."""
    mod = _user()
    torch.manual_seed(1234)
    model = mod.logprob_ok().model.eval()
    with torch.no_grad():
        return model(torch.tensor([seq.input_ids]))[0, :-1]


@pytest.mark.parametrize("name", ["zloss_ok", "entropy_ok"])
def test_a_term_no_label_moves_is_not_a_bug(engines, name):
    """The team's loss is cross-entropy plus a z-loss (or minus an entropy bonus): its logprobs are
    right, but -loss with one token labelled is the logprob minus that term - a BUG in Target.loss
    before (226x and 4.97e+03x beyond rounding, 18/18 tokens). Labelled otherwise, -loss moves as the
    float64 log-softmax does: the term is the loss's, not the logprob's."""
    from tpdiag.rollout.read import read_rollout

    s = _rollout(engines["float32"], name, file=ZFILE, micro_batch=(1,), modes=("prefill", "decode"))
    own = s["own_loss"]
    assert not own["bug"] and own["ratio"] <= 1 and own["label_free"] == own["tokens"] == 18, own
    assert not any(n.startswith("BUG") for n in s["notes"]), s["notes"]
    assert any("term that does not depend on the label" in n for n in s["notes"]), s["notes"]
    todo = s["what_to_do"]
    assert todo["case"] == "settings" and "fix your Target.loss" not in todo["line"], todo["line"]
    assert "healthy run" in todo["line"] and "does not depend on the label" in todo["line"], todo["line"]
    seqs = read_rollout(engines["float32"]).sequences
    for o in own["checked"]:
        # as a logprob, -loss is beyond rounding at every token: the term is what the relabelling isolates
        assert abs(o["own"] - o["float64"]) > o["bound"], o
        rows = _rows(seqs[o["seq"]]).double()
        j = o["position"] - 1
        if name == "zloss_ok":  # 1e-4 * logsumexp**2 at the one kept position
            want = -1e-4 * torch.logsumexp(rows[j], -1) ** 2
        else:  # + 0.01 * the mean entropy over every row, labelled or not
            lsm = rows.log_softmax(-1)
            want = 0.01 * -(lsm.exp() * lsm).sum(-1).mean()
        tol = max(t["bound"] for t in o["relabel"]["relabelled"])
        assert abs(o["relabel"]["term"] - float(want)) <= tol < abs(float(want)) / 50, (o["relabel"], float(want))


def test_a_double_shift_under_a_z_loss_is_still_a_bug(engines):
    s = _rollout(engines["float32"], "zloss_shift_twice", file=ZFILE, micro_batch=(1,),
                 modes=("prefill",))
    own = s["own_loss"]
    assert own["bug"] and own["ratio"] > 1e3 and own["beyond"] == own["tokens"] == 18, own
    assert own["label_free"] == 0
    # every token's offset from the float64 log-softmax moves far beyond rounding when labelled otherwise
    assert min(o["relabel"]["ratio"] for o in own["checked"]) > 1e2, [o["relabel"]["ratio"] for o in own["checked"]]
    note = next(n for n in s["notes"] if n.startswith("BUG in Target.loss"))
    assert "nor a term that does not depend on the label" in note, note
    assert "fix your Target.loss" in s["what_to_do"]["line"], s["what_to_do"]["line"]


def _judge(loss, rows, j, tok):
    from tpdiag.diff.bounds import logprob_bound
    from tpdiag.rollout import label_free

    n, v = rows.shape

    def minus_loss(t):
        labels = torch.full((1, n), -100)
        labels[0, j] = t
        return -loss(rows[None], labels)

    def bound_of(own, ref):
        return float(logprob_bound(rows[j][None], rows[j][None], own.reshape(1), torch.tensor([ref]), {})[0])

    lsm64 = rows[j].double().log_softmax(-1)
    own = minus_loss(tok)
    return label_free.judge(minus_loss, lsm64, tok, own, bound_of(own, float(lsm64[tok])), bound_of)


def _ce(logits, labels):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


@pytest.mark.parametrize("weight", [1e-4, 1.0, 1e3])
def test_a_label_free_term_of_any_size_reads_as_one_at_every_token(weight):
    """The add of a term of 1e3 nats rounds -loss by ~3e-5 nats - beyond the logprob's own rounding
    at a small one: the bound takes that rounding, at every token of every row."""
    torch.manual_seed(0)
    rows = torch.randn(6, 48) * 3

    def loss(logits, labels):
        keep = labels != -100
        return _ce(logits, labels) + weight * (torch.logsumexp(logits, -1) * keep).sum() / keep.sum()
    for j in range(6):
        for tok in range(48):
            r = _judge(loss, rows, j, tok)
            assert r["label_free"] and r["ratio"] <= 1, (j, tok, r)


@pytest.mark.parametrize("wrong", ["temperature", "shifted", "scaled", "no_label"])
def test_a_wrong_logprob_plus_a_label_free_term_is_not_one(wrong):
    torch.manual_seed(0)
    rows = torch.randn(6, 48) * 3

    def loss(logits, labels):
        z = 1e-4 * torch.logsumexp(logits, -1).square().mean()
        if wrong == "temperature":
            return _ce(logits / 0.7, labels) + z
        if wrong == "shifted":
            return _ce(logits[:, :-1], labels[:, 1:]) + z
        if wrong == "scaled":  # label smoothing's weight on the NLL, without its uniform term
            return 0.9 * _ce(logits, labels) + z
        return -0.01 * (logits.log_softmax(-1).exp() * logits.log_softmax(-1)).sum(-1).mean()
    for j in range(1, 6):
        for tok in range(0, 48, 5):
            r = _judge(loss, rows, j, tok)
            assert not r["label_free"] and r["ratio"] > 10, (j, tok, r)
