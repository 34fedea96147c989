"""An RL team's TP comparison of logprobs is of THEIR logprobs: `tpdiag compare --logprob
/--trainer-temperature/--temperature-in` takes the trainer's recipe (the one `tpdiag rollout` takes,
one implementation: tpdiag/runner/recipe.py) for the logprobs it records. At TP=1 they are the
user's own recipe on `from_pretrained(DIR, dtype=bfloat16)`'s logits bit for bit (torch.equal), and
no other recipe's; before, compare had no such option (exit 2) and recorded one fixed recipe. The
recipe is in manifest.json's and world.json's config (the default's keys left out: an older run
directory reads as the default recipe), in every world: under --fix all TP=2 records TP=1's bits.
The logprobs' rounding bound follows the recipe: a trainer's temperature T moves a logprob by up
to 2d/T for a logits difference d, which the cross-entropy's bound (2d) calls beyond rounding."""
import json

import pytest
import torch

from tests.conftest import run_cli

pytest.importorskip("transformers")

from tests.rl_team import save_bf16  # noqa: E402

T = 0.7
# (--logprob, --trainer-temperature, --temperature-in)
RECIPES = [("log-softmax", 1.0, "float32"), ("logsumexp", 1.0, "float32"), ("model-dtype", 1.0, "float32"),
           ("log-softmax", T, "model"), ("logsumexp", T, "float32"), ("model-dtype", T, "model")]


def _user(logits, labels):
    """The user's trainer, each recipe as TRL / verl / OpenRLHF write it, on the whole logits."""
    lab = labels.clamp_min(0)

    def gather(x):
        return x.gather(-1, lab[..., None])[..., 0]

    def selective_fp32(x):  # TRL's selective_log_softmax / verl's v2 for float32 logits
        return gather(x) - torch.stack([torch.logsumexp(row, dim=-1) for row in x])

    def selective_bf16(x):  # their branch for bf16 logits: a log_softmax per row, in bf16
        return torch.stack([row.log_softmax(-1).gather(-1, r[..., None])[..., 0] for row, r in zip(x, lab)]).float()

    with torch.no_grad():
        return {
            ("log-softmax", 1.0, "float32"): gather(logits.float().log_softmax(-1)),
            ("logsumexp", 1.0, "float32"): selective_fp32(logits.float()),
            ("model-dtype", 1.0, "float32"): selective_bf16(logits),
            ("log-softmax", T, "model"): gather((logits / T).float().log_softmax(-1)),
            ("logsumexp", T, "float32"): selective_fp32(logits.float() / T),
            ("model-dtype", T, "model"): selective_bf16(logits / T),
        }


def _args(key):
    return ["--logprob", key[0], "--trainer-temperature", str(key[1]), "--temperature-in", key[2]]


def _compare(out, path, *more):
    p = run_cli("compare", "--model", "hf:" + path, "--dtype", "bfloat16", "--device", "cpu", "--forward-only",
                "--no-confirm", "--no-baseline", "--batch-size", "4", "--seq-len", "16", *more,
                "--out", str(out), env={"OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-3000:] + p.stdout[-2000:]
    return p


def _recorded(run, label, kind="logprobs"):
    from tpdiag.records.store import RecordSet

    rs = RecordSet(str(run / f"tp{label}"))
    batch = {e["name"]: rs.tensor(e) for e in rs.events if e["kind"] == "batch"}
    return batch, rs.tensor(next(e for e in rs.events if e["kind"] == kind))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_bf16("qwen2", tmp_path_factory.mktemp("recipe") / "q")


def _users(path, batch):
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)  # the worlds' ranks run on one thread (a GEMM's bits can depend on it)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        logits = model(batch["input_ids"]).logits
    labels = batch["labels"]
    scored = (labels != -100).flatten()
    return {k: v.flatten()[scored] for k, v in _user(logits, labels).items()}, scored


# the default is tests/test_load_dtype.py's; logsumexp (at T, divided in float32) the TP=2 test's
# below: each recipe and each place of the division once, three compares in all
@pytest.mark.parametrize("key", [RECIPES[3], RECIPES[5]], ids=lambda k: "-".join(map(str, k)))
def test_compare_records_the_users_recipe_bit_for_bit(tmp_path, ckpt, key):
    run = tmp_path / "r"
    p = _compare(run, ckpt, "--tp", "1,1", *_args(key))
    batch, lp = _recorded(run, "1")
    user, scored = _users(ckpt, batch)
    got = lp.flatten()[scored]
    assert lp.dtype == torch.float32
    assert torch.equal(got, user[key]), key
    # negative control: every other recipe is other bits on this batch (so the equality above is
    # the recipe's, not any logprob's)
    for other, want in user.items():
        if other != key:
            assert not torch.equal(got, want), (key, other)
    from tpdiag.config import CompareConfig, WorldConfig
    from tpdiag.runner.recipe import Recipe

    cfg = json.loads((run / "manifest.json").read_text())["config"]
    assert cfg["trainer_temperature"] == key[1]
    assert Recipe.of(CompareConfig.from_dict(cfg)) == Recipe(*key)
    world = json.loads((run / "tp1" / "world.json").read_text())["config"]
    assert Recipe.of(WorldConfig.from_dict(world)) == Recipe(*key)
    assert "logprob recipe (--logprob): " in p.stdout


def test_a_tp2_world_takes_the_recipe(tmp_path, ckpt):
    """Under --fix all a TP=2 world gathers the vocab and takes the user's recipe too: TP=1's bits
    (a world that took the default would not divide by T at all), each the user's recipe on that
    world's logits (the fixed kernels' logits, not the stock model's)."""
    key = ("logsumexp", T, "float32")
    run = tmp_path / "r"
    _compare(run, ckpt, "--tp", "1,2", "--fix", "all", *_args(key))
    batch, lp1 = _recorded(run, "1")
    _, lp2 = _recorded(run, "2")
    _, logits = _recorded(run, "1", "logits")
    labels = batch["labels"]
    scored = (labels != -100).flatten()
    user = {k: v.flatten()[scored] for k, v in _user(logits, labels).items()}
    assert torch.equal(lp1.flatten()[scored], user[key])
    assert not torch.equal(lp1.flatten()[scored], user[("log-softmax", 1.0, "float32")])
    assert torch.equal(lp2, lp1)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["degrees"]["2"]["logprobs"]["bitwise"] is True


def test_an_older_run_directory_reads_as_the_default_recipe():
    from tpdiag.config import CompareConfig, WorldConfig
    from tpdiag.runner.recipe import Recipe

    cfg = CompareConfig.of(degrees=(1, 2))
    d = cfg.to_dict()
    assert not {"logprob", "trainer_temperature", "temperature_in"} & set(d)  # the files as before
    old = CompareConfig.from_dict(d)
    assert Recipe.of(old).default and Recipe.of(old) == Recipe()
    new = cfg.with_(logprob="model-dtype", trainer_temperature=T, temperature_in="model")
    back = CompareConfig.from_dict(json.loads(json.dumps(new.to_dict())))
    assert Recipe.of(back) == Recipe("model-dtype", T, "model")
    w = new.world(new.worlds()[1].point, "2", "/tmp/x", "cpu")
    assert Recipe.of(WorldConfig.from_dict(w.to_dict())) == Recipe("model-dtype", T, "model")


def test_a_bad_recipe_is_one_line_before_any_world(tmp_path):
    p = run_cli("compare", "--tp", "1,2", "--device", "cpu", "--logprob", "model-dtype", "--trainer-temperature",
                "0.5", "--out", str(tmp_path / "r"))
    assert p.returncode == 2, p.stdout + p.stderr
    assert "add --temperature-in model" in p.stderr and not (tmp_path / "r" / "tp1").exists()


def test_the_logprobs_bound_follows_the_trainers_temperature():
    """Two sides' bf16 logits a rounding apart (1 ULP at 8 of 256 ids a row), each side's logprobs
    by the recipe: within the recipe's bound everywhere, where the cross-entropy's bound (the
    default recipe's, 2d) is exceeded at T=0.25 - compare would have called rounding a BUG."""
    from tpdiag.diff.bounds import logprob_bound
    from tpdiag.runner.recipe import logprobs, parse

    g = torch.Generator().manual_seed(0)
    z1 = (torch.randn(256, 256, generator=g) * 3).bfloat16()
    zn = z1.clone()
    idx = torch.randint(0, 256, (256, 8), generator=g)
    zn.scatter_(1, idx, (zn.gather(1, idx).float() * (1 + 2 ** -7)).bfloat16())
    lab = z1.float().argmin(-1)  # the tail, where a logprob's rounding is largest
    for key in [("log-softmax", 0.25, "float32"), ("log-softmax", 0.25, "model"), ("logsumexp", 0.25, "float32"),
                ("model-dtype", 0.25, "model")]:
        a, b = logprobs(z1, lab, parse(*key)), logprobs(zn, lab, parse(*key))
        d = (a.double() - b.double()).abs()
        rec = dict(logprob=key[0], trainer_temperature=key[1], temperature_in=key[2])
        assert bool((d <= logprob_bound(z1, zn, a, b, rec)).all()), key
        assert bool((d > logprob_bound(z1, zn, a, b)).any()), key  # the default's bound: too tight
