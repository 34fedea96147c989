"""--layers N (models/slice.py) and the memory preflight (models/preflight.py)."""
from __future__ import annotations

import json

import pytest
import torch
from conftest import run_cli
from hf_configs import write_tiny

from tpdiag.errors import BadInput

GiB = 1 << 30
# Llama-3.x-70B's shape: 80 layers, hidden 8192, GQA 64/8 heads of 128, ffn 28672, vocab 128256
L70B = dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
            num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=131072,
            rope_theta=500000.0, dtype="bfloat16")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int8 if t.element_size() == 1 else
                               {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def test_slice_runs_the_real_first_layers_bitwise(tmp_path):
    """A 3-layer Qwen3 (layer_types per layer) with --layers 1: the manifest, summary and `ran:`
    line say so, no record of another layer exists, and every record of layer 0 and the
    embedding, and the initial value of every parameter the slice has (the head and final norm
    included), is bitwise the full model's at TP=1."""
    spec = write_tiny("qwen3", tmp_path / "m", num_hidden_layers=3)
    full, cut = tmp_path / "full", tmp_path / "cut"
    p = run_cli("compare", "--model", spec, "--tp", "1,1", "--forward-only", "--no-baseline", "--no-confirm",
                "--format", "json", "--out", str(full))
    assert p.returncode == 0, p.stderr
    # what a slice records and says: no own-input judgement past the first divergence
    p = run_cli("compare", "--model", spec, "--layers", "1", "--tp", "1,2", "--forward-only", "--no-confirm",
                "--no-judge-downstream", "--verbose", "--out", str(cut))
    assert p.returncode == 0, p.stderr
    assert "model: the first 1 of 3 decoder layers with the real embedding and head (--layers 1)" in p.stdout
    # --verbose: where the time went, after the verdict
    assert "\ntime: " in p.stdout and "world: TP=1 (reference rerun)" in p.stdout and "model build" in p.stdout
    m = json.loads((cut / "manifest.json").read_text())
    assert m["slice"]["layers"] == 1 and m["slice"]["total_layers"] == 3
    assert m["slice"]["config"] == {"num_hidden_layers": "3 -> 1", "layer_types": "first 1 of 3"}
    assert m["config"]["layers"] == 1 and m["preflight"]["degrees"]["2"]["fits"] is True
    assert json.loads((cut / "summary.json").read_text())["slice"]["layers"] == 1
    from tpdiag.records.store import RecordSet

    a, b = RecordSet(str(full / "tp1")), RecordSet(str(cut / "tp1"))
    full_by_key = {e["key"]: e for e in a.events}
    assert not [e for e in b.events if "layers.1" in e["module"] or "layers.2" in e["module"]]
    shared = [e for e in b.events if e["kind"] == "param_init" or e["module"] == "model.embed_tokens"
              or e["module"].startswith("model.layers.0")]
    assert len(shared) > 20 and any(e["module"] == "lm_head" for e in shared)
    for e in shared:
        assert torch.equal(_bits(b.tensor(e)), _bits(a.tensor(full_by_key[e["key"]]))), e["key"]
    # control: the records after layer 0 do see the missing layers (the final norm's output)
    (norm,) = [e for e in b.events if e["module"] == "model.norm" and e["kind"] == "out"]
    assert not torch.equal(b.tensor(norm), a.tensor(full_by_key[norm["key"]]))


def test_seeded_init_gives_the_slice_the_full_models_weights(tmp_path):
    """tpdiag's init draws each module from (seed, its fqn): layer 0, the embedding and the head
    of a slice are the full model's. Negative control: transformers' own CPU init from one
    global RNG stream (from_config) draws tensors in an order that depends on the other layers,
    so there the slice's head is not the full model's."""
    from tpdiag.models.hf import load_model

    path = write_tiny("llama", tmp_path / "m", num_hidden_layers=3)[3:]
    full = load_model(path, torch.device("cpu"), seed=7).state_dict()
    cut = load_model(path, torch.device("cpu"), seed=7, layers=1).state_dict()
    assert set(cut) < set(full) and not [k for k in cut if "layers.1." in k]
    for k, t in cut.items():
        assert torch.equal(_bits(t), _bits(full[k])), k
    torch.manual_seed(7)
    g_full = load_model(path).state_dict()
    torch.manual_seed(7)
    g_cut = load_model(path, layers=1).state_dict()
    differ = [k for k, t in g_cut.items() if not torch.equal(t, g_full[k])]
    assert "lm_head.weight" in differ, differ
    # the built-in presets scale wo / w2 by the depth: a slice keeps the whole model's depth there
    from tpdiag.models import tiny_llama
    from tpdiag.models.build import build_target
    from tpdiag.models.spec import parse_spec

    a = build_target(parse_spec("tiny-llama"), "stock", torch.device("cpu"), 7).model.state_dict()
    b = build_target(parse_spec("tiny-llama", 1), "stock", torch.device("cpu"), 7).model.state_dict()
    assert set(b) < set(a)
    for k, t in b.items():
        assert torch.equal(t, a[k]), k
    shallow = tiny_llama.build_on("cpu", 7, "tiny-llama", n_layers=1).state_dict()  # a 1-layer model
    assert not torch.equal(shallow["layers.0.attention.wo.weight"], a["layers.0.attention.wo.weight"])


def test_slice_cuts_per_layer_lists_and_index_lists():
    from transformers import AutoConfig

    from tpdiag.models.slice import dropped_key, slice_text_config

    c = AutoConfig.for_model("qwen3_moe", num_hidden_layers=6, mlp_only_layers=[0, 4],
                             layer_types=["full_attention"] * 6)
    changed = slice_text_config(c, 2)
    assert c.num_hidden_layers == 2 and c.layer_types == ["full_attention"] * 2 and c.mlp_only_layers == [0]
    assert set(changed) == {"num_hidden_layers", "layer_types", "mlp_only_layers"}
    assert dropped_key("model.layers.2.mlp.gate.weight", 2) and not dropped_key("model.layers.1.mlp.up.weight", 2)
    assert not dropped_key("lm_head.weight", 2) and not dropped_key("model.embed_tokens.weight", 2)


@pytest.fixture(scope="module")
def spec70b(tmp_path_factory):
    from tpdiag.models.spec import parse_spec

    return parse_spec(write_tiny("llama", tmp_path_factory.mktemp("l70b"), **L70B))


def test_preflight_proposes_a_slice_for_a_70b_shaped_model(spec70b):
    """Counted on the meta device (no memory), 70.6B parameters: bf16 training state alone is
    565 GB, past one 141 GiB GPU and past four. The refusal names the slice that fits."""
    from dataclasses import replace

    from tpdiag.models.capacity import model_dims, param_counts
    from tpdiag.models.preflight import need_bytes, preflight

    outside, per = param_counts(spec70b)
    assert len(per) == 80 and outside + sum(per) == 70_553_706_496
    have = (139 * GiB, "free on a test GPU")
    args = (1, 2048, "bfloat16", True)
    with pytest.raises(BadInput) as e:
        preflight(spec70b, (1, 2, 4), *args, "cuda", gpus=4, have=have)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("--tp 1: the reference world needs at least")
    n = int(msg.split("--layers ")[1].split()[0])
    assert "take TP=" not in msg  # TP=4's bound alone is 131.4 GiB per GPU (AdamW's step): no degree to offer
    # what it proposes leaves half the memory for what the lower bound leaves out
    fits = lambda k, d: need_bytes(model_dims(replace(spec70b, layers=k)), d, *args, "cuda") <= have[0] // 2  # noqa: E731
    assert fits(n, 1) and not fits(n + 1, 1), n
    # the slice it proposes passes, and says which degrees fit
    ok = preflight(replace(spec70b, layers=n), (1, 2, 4), *args, "cuda", gpus=4, have=have)
    assert ok["layers"] == n and ok["total_layers"] == 80
    assert all(v["fits"] for v in ok["degrees"].values())
    # forward only (nothing kept for backward): the weights and the loss, 133.9 GiB at TP=1 - within
    # 139 GiB; on 100 GiB the whole model fits at TP=4 within half the memory: offered as the reference
    assert preflight(spec70b, (1,), 1, 2048, "bfloat16", False, "cuda", gpus=4, have=have)["degrees"]["1"]["fits"]
    with pytest.raises(BadInput, match=r"or take TP=4 as the reference"):
        preflight(spec70b, (1, 2, 4), 1, 2048, "bfloat16", False, "cuda", gpus=4, have=(100 * GiB, "free"))
    # the CPU: one host for every rank, the degree does not help; a slice does
    with pytest.raises(BadInput, match=r"diagnose a slice: --layers \d+ \(the first \d+ of 80"):
        preflight(spec70b, (1, 2), *args, "cpu", have=(64 * GiB, "available host memory"))


def test_layers_bad_input_is_one_line(tmp_path):
    from tpdiag.config import CompareConfig
    from tpdiag.runner.compare import validate

    spec = write_tiny("llama", tmp_path / "m")
    for cfg, words in ((CompareConfig.of(model=spec, degrees=(1, 2), layers=3), "the model has 2 decoder layers"),
                       (CompareConfig.of(model=spec, degrees=(1, 2), layers=-1), "must be >= 1"),
                       (CompareConfig.of(model="py:tests/models/unsharded.py:target", degrees=(1, 2), layers=1),
                        "a py: target builds its own model")):
        with pytest.raises(BadInput, match=words):
            validate(cfg)


def test_depth_scaled_init_is_the_whole_models(tmp_path, monkeypatch):
    """GPT-2's init scales c_proj by 1/sqrt(2 * n_layer): the slice's init rules run with the
    whole model's depth. Negative control: without that, c_proj differs."""
    from tpdiag.models import slice as sl
    from tpdiag.models.hf import load_model

    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_layer": 3, "n_embd": 64, "n_head": 4,
        "vocab_size": 128, "n_positions": 64}))
    full = load_model(str(tmp_path), torch.device("cpu"), seed=3).state_dict()
    cut = load_model(str(tmp_path), torch.device("cpu"), seed=3, layers=1).state_dict()
    assert [k for k, t in cut.items() if not torch.equal(t, full[k])] == []
    monkeypatch.setattr(sl.whole_depth, "__enter__", lambda self: None)
    monkeypatch.setattr(sl.whole_depth, "__exit__", lambda self, *e: False)
    cut = load_model(str(tmp_path), torch.device("cpu"), seed=3, layers=1).state_dict()
    assert [k for k, t in cut.items() if not torch.equal(t, full[k])] == ["transformer.h.0.attn.c_proj.weight",
                                                                          "transformer.h.0.mlp.c_proj.weight"]


def test_moe_slices_keep_each_layers_kind(tmp_path):
    """DeepSeek-V3's layer 0 is dense (first_k_dense_replace=1), layer 1 MoE; gpt-oss alternates
    sliding and full attention (layer_types): a slice's layer i is the model's layer i."""
    from tpdiag.models.hf import meta_build

    ds = write_tiny("deepseek_v3", tmp_path / "ds")[3:]
    for n in (1, 2):
        model = meta_build(ds, layers=n)[0]
        kinds = ["moe" if hasattr(layer.mlp, "experts") else "dense" for layer in model.model.layers]
        assert kinds == ["dense", "moe"][:n], kinds
    oss = write_tiny("gpt_oss", tmp_path / "oss", num_hidden_layers=4,
                     layer_types=["sliding_attention", "full_attention"] * 2)[3:]
    model = meta_build(oss, layers=3)[0]
    assert model.config.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    assert len(model.model.layers) == 3


def test_slice_of_a_checkpoint_reads_only_its_layers(tmp_path):
    """A safetensors checkpoint of 3 layers under --layers 1: read tensor by tensor straight into
    the slice (the dropped layers' keys skipped, not a fallback to from_pretrained), each tensor
    the checkpoint's."""
    import hf_configs
    from safetensors.torch import load_file

    from tpdiag.models.hf import load_model, meta_build

    path = write_tiny("llama", tmp_path / "m", num_hidden_layers=3)[3:]
    hf_configs._mod.write_weights(path)
    built = meta_build(path, layers=1)
    assert built is not None and not [k for k in built[1] if "layers.1." in k or "layers.2." in k]
    ckpt = {}
    for f in (tmp_path / "m").glob("*.safetensors"):
        ckpt.update(load_file(str(f)))
    cut = load_model(path, torch.device("cpu"), seed=1, layers=1).state_dict()
    assert {k for k in ckpt if "layers.1." not in k and "layers.2." not in k} <= set(cut)
    for k, t in cut.items():
        if k in ckpt:
            assert torch.equal(t, ckpt[k].to(t.dtype)), k


@pytest.mark.parametrize("preset", ["tiny-llama", "llama-1b"])
def test_builtin_param_counts_are_the_built_models(preset):
    """A built-in preset's counts come from its config (LlamaConfig.param_counts), not a build:
    they must be what the model built on the meta device holds, outside the layers and per layer."""
    import re

    from tpdiag.models import tiny_llama
    from tpdiag.models.capacity import param_counts
    from tpdiag.models.spec import parse_spec

    with torch.device("meta"):
        model = tiny_llama.build(preset)
    outside, per = 0, [0] * model.cfg.n_layers
    for name, p in model.named_parameters():
        m = re.match(r"layers\.(\d+)\.", name)
        if m is None:
            outside += p.numel()
        else:
            per[int(m.group(1))] += p.numel()
    assert param_counts(parse_spec(preset)) == (outside, tuple(per))


def test_builtin_preflight_leaves_dynamo_unimported():
    """compare's memory preflight of a built-in preset builds nothing on the meta device, whose
    Python kernels import torch._dynamo into compare's own process (1.5-7 s of its checks on a
    2-core host): after it, torch._dynamo is still not imported."""
    import subprocess
    import sys

    code = ("import sys, torch\n"
            "from tpdiag.models.preflight import preflight\n"
            "from tpdiag.models.spec import parse_spec\n"
            "out = preflight(parse_spec('llama-1b'), (1, 2), 1, 2048, 'bfloat16', True, 'cpu', have=(1 << 50, 'x'))\n"
            "assert all(v['fits'] for v in out['degrees'].values()), out\n"
            "print('torch._dynamo' in sys.modules)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"
