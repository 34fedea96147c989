"""A checkpoint whose model has a tensor no init rule fills: Apertus' XIELU activation sets its
alpha_p/alpha_n in its own __init__ (lost when tpdiag builds the model on the meta device) and no
`_init_weights` rule fills them. tpdiag's NaN check refused every Apertus checkpoint before
loading it ("model.layers.0.mlp.act_fn.alpha_p: not initialised by its module's init rule"), at
TP=1 (rollout, compare's reference) and shard by shard at TP > 1 - although the checkpoint holds
them. A tensor the checkpoint fills needs no rule; one it lacks is still refused, by name."""
import pytest
import torch

pytest.importorskip("transformers", minversion="5")

CFG = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=256,
           tie_word_embeddings=False)


@pytest.fixture(scope="module")
def apertus(tmp_path_factory):
    from transformers import AutoConfig, AutoModelForCausalLM

    path = tmp_path_factory.mktemp("apertus") / "ckpt"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("apertus", **CFG))
    with torch.no_grad():  # not the __init__ values: what tpdiag holds must be the checkpoint's
        for name, p in model.named_parameters():
            if name.endswith(("alpha_p", "alpha_n")):
                p.add_(torch.randn(p.shape))
    model.save_pretrained(path)
    user = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return str(path), user


def _same_tensors(mine, user):
    want = dict(user.named_parameters())
    got = dict(mine.named_parameters())
    assert set(got) == set(want) and any(n.endswith("alpha_p") for n in got)
    for name, t in want.items():
        assert torch.equal(got[name].detach(), t.detach()), name


def test_a_checkpoint_fills_what_no_init_rule_does(apertus):
    from tpdiag.models.hf import load_model

    path, user = apertus
    model = load_model(path, device="cpu").eval()
    _same_tensors(model, user)
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, user(ids).logits)


def test_shard_by_shard_too(apertus):
    from tpdiag.models import weights
    from tpdiag.models.hf import init_guard, init_rule, meta_build
    from tpdiag.models.shard_init import materialize_sharded

    path, user = apertus
    model, mapping = meta_build(path)
    with weights.filler(model, mapping, "cpu") as fill:
        materialize_sharded(model, "cpu", 0, init_rule(model), torch.float32, fill=fill, context=init_guard)
    _same_tensors(model, user)


def test_a_tensor_the_checkpoint_lacks_is_still_refused(apertus, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from tpdiag.errors import BadInput
    from tpdiag.models import weights
    from tpdiag.models.hf import init_guard, init_rule, load_model, meta_build
    from tpdiag.models.shard_init import materialize_sharded

    path, _ = apertus
    shutil.copytree(path, tmp_path / "c")
    f = tmp_path / "c" / "model.safetensors"
    sd = load_file(str(f))
    del sd["model.layers.1.mlp.act_fn.alpha_n"]
    save_file(sd, str(f), metadata={"format": "pt"})
    with pytest.raises(BadInput, match=r"^model\.layers\.1\.mlp\.act_fn\.alpha_n: not initialised"):
        load_model(str(tmp_path / "c"), device="cpu")
    model, mapping = meta_build(str(tmp_path / "c"))
    with pytest.raises(BadInput, match=r"^model\.layers\.1\.mlp\.act_fn\.alpha_n: not initialised"):
        with weights.filler(model, mapping, "cpu") as fill:
            materialize_sharded(model, "cpu", 0, init_rule(model), torch.float32, fill=fill, context=init_guard)
