"""The user's model as the user loads it: tpdiag's TP=1 model of an hf: checkpoint in bf16 computes
the logits transformers' own `from_pretrained(DIR, dtype=torch.bfloat16)` computes, bit for bit
(float32 buffers such as RoPE's inv_freq, and keep-in-fp32 modules, stay float32) - and the model
cast with `.to(bfloat16)`, what tpdiag used to run, does not. At TP=2 the same tensors keep the
same dtypes (the sharded materialisation casts by the same rule)."""
import json

import pytest
import torch

from tests.conftest import run_cli
from tests.hf_configs import write_tiny

pytest.importorskip("transformers")


def _checkpoint(tmp_path, kind, **over) -> str:
    """A tiny checkpoint WITH weights (save_pretrained), so from_pretrained has real ones."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = write_tiny(kind, tmp_path / kind, **over)[3:]
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=torch.float32).save_pretrained(path)
    return path


def _ours(path: str, dtype: str = "bfloat16"):
    from tpdiag.config import WorldConfig
    from tpdiag.runner.build import build_model

    cfg = WorldConfig.of(model="hf:" + path, degree=1, label="1", out_dir="", dtype=dtype)
    return build_model(cfg, torch.device("cpu"), 1)[1].eval()


def _dtypes(model) -> dict:
    return {n: t.dtype for n, t in list(model.named_parameters()) + list(model.named_buffers())}


@pytest.mark.parametrize("kind,over", [("llama", {"rope_theta": 500000.0}), ("qwen3", {}),
                                       ("qwen3_moe", {}), ("deepseek_v3", {})])
def test_tp1_logits_are_from_pretrained_bf16_bitwise(tmp_path, kind, over):
    from transformers import AutoModelForCausalLM

    path = _checkpoint(tmp_path, kind, **over)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    ours = _ours(path)
    assert _dtypes(ours) == _dtypes(ref)
    assert ours.model.rotary_emb.inv_freq.dtype == torch.float32
    if kind == "deepseek_v3":  # _keep_in_fp32_modules_strict: the router's gate and its bias
        assert ours.model.layers[1].mlp.gate.weight.dtype == torch.float32
    ids = torch.randint(0, ref.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    cast = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(torch.bfloat16).eval()
    with torch.no_grad():
        want, got, old = ref(ids).logits, ours(ids).logits, cast(ids).logits
    assert torch.equal(got, want)
    # negative control: the float32 model cast with .to(bf16) - inv_freq in bf16 - is another model
    assert cast.model.rotary_emb.inv_freq.dtype == torch.bfloat16
    assert not torch.equal(old, want)


def test_random_init_is_from_pretrained_of_its_float32_save(tmp_path):
    """No weights: tpdiag's seeded float32 init, cast by the rule, is what from_pretrained(bf16)
    gives for that init saved as a checkpoint."""
    from transformers import AutoModelForCausalLM

    spec = write_tiny("llama", tmp_path / "cfg", rope_theta=500000.0)
    f32 = _ours(spec[3:], "float32")
    f32.save_pretrained(str(tmp_path / "saved"))
    ref = AutoModelForCausalLM.from_pretrained(str(tmp_path / "saved"), dtype=torch.bfloat16).eval()
    ours = _ours(spec[3:])
    ids = torch.randint(0, 512, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, ref(ids).logits)


def test_builtin_keeps_float32_rotary_tables_and_py_model_in_dtype_is_not_recast():
    from torch import nn

    from tpdiag.models import dtypes

    model = _builtin_bf16()
    assert model.rope_cos.dtype == torch.float32 and model.tok_embeddings.weight.dtype == torch.bfloat16

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4, dtype=torch.bfloat16)
            self.register_buffer("scale", torch.ones(4, dtype=torch.float32))

    m = M()
    dtypes.to_run_dtype("py", m, torch.bfloat16)
    assert m.scale.dtype == torch.float32  # built in the run's dtype: nothing recast
    m2 = nn.Linear(4, 4)
    m2.register_buffer("scale", torch.ones(4))
    dtypes.to_run_dtype("py", m2, torch.bfloat16)  # built in float32: nn.Module.to's cast, as before
    assert m2.weight.dtype == torch.bfloat16 and m2.scale.dtype == torch.bfloat16


def _builtin_bf16():
    from tpdiag.config import WorldConfig
    from tpdiag.runner.build import build_model

    cfg = WorldConfig.of(model="tiny-llama", degree=1, label="1", out_dir="", dtype="bfloat16")
    return build_model(cfg, torch.device("cpu"), 1)[1]


def test_tp2_keeps_the_same_dtypes_and_records_them(tmp_path):
    """A real TP=1,2 compare (gloo) of an hf: checkpoint in bf16: both worlds record inv_freq in
    float32 and every parameter in bf16 (the sharded path casts by the same rule), and the flags
    and the thread count each world ran under."""
    path = _checkpoint(tmp_path, "llama", rope_theta=500000.0)
    out = tmp_path / "run"
    # the worlds' dtypes and flags: no own-input judgement past the first divergence
    p = run_cli("compare", "--model", "hf:" + path, "--tp", "1,2", "--dtype", "bfloat16", "--forward-only",
                "--no-confirm", "--no-baseline", "--no-judge-downstream", "--out", str(out))
    assert p.returncode == 0, p.stderr + p.stdout
    assert "flags deterministic: deterministic algorithms on" in p.stdout
    man = json.loads((out / "manifest.json").read_text())
    assert man["flags"] == "deterministic"
    # the suite's OMP_NUM_THREADS=1 (conftest), the user's choice, which runner/host_threads keeps
    assert man["launcher_threads"] == 1
    for label in ("1", "2"):
        n = man["worlds"][label]["numerics"]
        assert n["buffer_dtypes"]["model.rotary_emb.inv_freq"] == "float32", label
        assert n["param_dtypes"] == {"bfloat16": 21}, label
        assert n["flag_values"]["deterministic_algorithms"] is True
        assert n["threads"] == 1, label  # one thread a rank in every world
    # the logprobs are the trainer's: transformers' own bf16 logits upcast to float32, then
    # log-softmax (NeMo RL, verl; generate()'s output_logits) - bit for bit at TP=1. They were a
    # bf16 log-softmax (each logprob rounded to 8 bits: 2 of its ULPs near -5 are 0.0625, and the
    # TP=2 logprob error read mostly that rounding)
    from transformers import AutoModelForCausalLM

    from tpdiag.records.store import RecordSet

    rs = RecordSet(str(out / "tp1"))
    batch = {e["name"]: rs.tensor(e) for e in rs.events if e["kind"] == "batch"}
    lp = rs.tensor(next(e for e in rs.events if e["kind"] == "logprobs"))
    torch.set_num_threads(1)  # the worlds' ranks run on one thread (a GEMM's bits can depend on it)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    with torch.no_grad():
        logits = model(batch["input_ids"]).logits
    labels = batch["labels"].flatten()
    scored = labels != -100
    theirs = logits.float().log_softmax(-1).flatten(0, 1)[torch.arange(len(labels)), labels.clamp(min=0)]
    assert lp.dtype == torch.float32
    assert torch.equal(lp[scored], theirs[scored])
    # the step's loss is the float32 cross-entropy of the logits upcast, transformers' own
    # (ForCausalLMLoss), bit for bit - it was a bf16 cross-entropy (tests/test_user_loss_bits.py)
    loss = rs.tensor(next(e for e in rs.events if e["kind"] == "loss"))
    with torch.no_grad():
        hf_loss = model(batch["input_ids"], labels=batch["input_ids"]).loss
    assert loss.dtype == hf_loss.dtype == torch.float32 and torch.equal(loss, hf_loss)


def test_logprobs_in_blocks_of_rows_are_the_whole_tensors(monkeypatch):
    # compare's logprobs upcast 16-bit logits a block of rows at a time (never a whole [T, V] float32
    # copy): the same bits as the whole tensor's upcast log-softmax, ignored labels included
    from tpdiag.runner import losses

    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(2, 25, 96, generator=g) * 4).to(torch.bfloat16)
    labels = torch.randint(0, 96, (2, 25), generator=g)
    labels[0, :3] = -100
    whole = -torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100,
                                               reduction="none")
    monkeypatch.setattr(losses, "CHUNK_ELEMENTS", 96 * 7)  # 7 rows a block: 8 blocks, the last of 1
    got = losses.token_logprobs(logits, labels)
    assert got.dtype == torch.float32 and torch.equal(got, whole)
    assert torch.equal(got, logits.float().log_softmax(-1).flatten(0, 1).gather(
        -1, labels.flatten().clamp(min=0)[:, None])[:, 0].masked_fill(labels.flatten() == -100, 0.0))
