"""Decode vs prefill (issue #39 item 2) on real models: the built-in KV cache and transformers'
cache, driven by tpdiag.runner.decode (the prompt in one call, then one token per call).

Stock kernels: decode's logits are prefill's up to rounding, not bitwise (other GEMM and
attention shapes: the negative control). Under every fix (`apply_fixes(resolve('all'))`, as the
runner applies them): bitwise prefill's, at TP=1 and in a real TP=2 gloo world, for tiny-llama
and a tiny hf: llama, float32 and bfloat16 - and the TP=2 decode is the TP=1 prefill's bits.
"""
import os

import pytest
import torch
import torch.distributed as dist

from conftest import gloo_world

B, S = 2, 16
CASES = [("tiny-llama", "float32"), ("tiny-llama", "bfloat16"), ("hf", "float32"), ("hf", "bfloat16")]


def _spec(kind, hf_dir):
    return kind if kind != "hf" else "hf:" + hf_dir


_TP1 = {}


def tp1(spec, dtype, fix):
    """logits(..., world=1), computed once per test session."""
    key = (spec, dtype, fix)
    if key not in _TP1:
        _TP1[key] = logits(spec, dtype, fix, 1)
    return _TP1[key]


def logits(spec, dtype, fix, world, prompt_len=None, calls=None):
    """(prefill logits, decode logits), whole [B, S, vocab], in this process (rank of `world`)."""
    from torch.distributed.tensor import DTensor

    from tpdiag.config import WorldConfig
    from tpdiag.fixes.registry import apply_fixes, resolve
    from tpdiag.kernels.tree import install_tree_groups
    from tpdiag.runner import determinism
    from tpdiag.runner.decode import assemble, decode, default_prompt_len
    from tpdiag.runner.build import build_model
    from tpdiag.runner.logits import logits_of

    determinism.setup(1234, "cpu")
    cfg = WorldConfig.of(model=spec, degree=world, label="t", out_dir="", dtype=dtype)
    target, model = build_model(cfg, torch.device("cpu"), world)
    model.eval()
    ids = torch.randint(0, target.vocab_size, (B, S), generator=torch.Generator().manual_seed(1))
    P = prompt_len or default_prompt_len(S)
    on_call = (lambda a, b: calls.append((a, b))) if calls is not None else None
    with torch.no_grad(), install_tree_groups(2), apply_fixes(resolve(fix), model=model, plan=target.plan, world=world):
        pre = logits_of(model(ids))
        dec = assemble(decode(model, ids, P, on_call=on_call))
    whole = lambda t: t.full_tensor() if isinstance(t, DTensor) else t  # noqa: E731
    return whole(pre), whole(dec)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    pytest.importorskip("transformers")
    from hf_configs import write_tiny

    return write_tiny("llama", tmp_path_factory.mktemp("hf-llama"))[len("hf:"):]


def _bytes(t):
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes(), str(t.dtype)[len("torch."):]


def _unbytes(b, dt):
    return torch.frombuffer(bytearray(b), dtype=torch.uint8).view(getattr(torch, dt)).view(B, S, -1)


def test_driver_calls_and_stock_decode_is_prefill_up_to_rounding():
    calls = []
    pre, dec = logits("tiny-llama", "float32", "none", 1, calls=calls)
    assert calls == [(0, 8)] + [(t, t + 1) for t in range(8, S)]  # default prompt: half the sequence
    assert torch.allclose(pre, dec, rtol=0, atol=1e-5)
    assert torch.equal(pre[:, 0], dec[:, 0])  # position 0 attends to itself only, one GEMM row
    # negative control: stock kernels, other shapes (M = 2 decode rows, 8 prompt keys) - not bitwise
    assert not torch.equal(pre, dec)


def test_prompt_len_and_last_only_pieces():
    from tpdiag.models import tiny_llama
    from tpdiag.runner.decode import Unsupported, decode

    model = tiny_llama.build_on(torch.device("cpu"), 0).eval()
    ids = torch.randint(0, 512, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        pieces = decode(model, ids, 4, prompt_rows="last")
        assert [(p.start, p.stop, p.logits.shape[1]) for p in pieces] == [(3, 4, 1), (4, 5, 1), (5, 6, 1)]
        assert [(p.start, p.stop) for p in decode(model, ids, 6)] == [(0, 6)]  # the whole prompt
        with pytest.raises(Unsupported, match="^the built-in KV cache takes no attention mask"):
            decode(model, ids, 3, attention_mask=torch.tensor([[0, 1, 1, 1, 1, 1]]))

        # a py: model's cache is its own: the refusal named it "the built-in KV cache"
        class UserLM(torch.nn.Module):
            def new_kv_cache(self):
                return []

            def forward(self, tokens, cache=None):
                return model(tokens)

        with pytest.raises(Unsupported, match=r"^UserLM's KV cache \(new_kv_cache\(\), forward\(tokens, "
                                              r"cache=\.\.\.\)\) takes no attention mask"):
            decode(UserLM(), ids, 3, attention_mask=torch.tensor([[0, 1, 1, 1, 1, 1]]))
        with pytest.raises(Unsupported, match="prompt length"):
            decode(model, ids, 0)
        with pytest.raises(Unsupported, match="no KV cache"):
            decode(torch.nn.Linear(2, 2), ids, 1)


@pytest.mark.parametrize("kind,dtype", CASES)
def test_fix_all_decode_is_prefill_bitwise_tp1(kind, dtype, hf_dir):
    pre, dec = tp1(_spec(kind, hf_dir), dtype, "all")
    assert torch.equal(pre.view(torch.int16 if dtype == "bfloat16" else torch.int32),
                       dec.view(torch.int16 if dtype == "bfloat16" else torch.int32))
    if kind == "hf":  # negative control for the hf: model (tiny-llama's is above)
        spre, sdec = tp1(_spec(kind, hf_dir), dtype, "none")
        assert not torch.equal(spre, sdec)


def _worker(rank, world, port, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    hf_dir = os.environ["TPDIAG_TEST_HF_DIR"]
    out = {}
    for kind, dtype in CASES:
        pre, dec = logits(_spec(kind, hf_dir), dtype, "all", world)
        out[f"{kind}-{dtype}"] = (_bytes(pre), _bytes(dec))
    pre, dec = logits("tiny-llama", "float32", "none", world)
    out["stock"] = (_bytes(pre), _bytes(dec))
    if rank == 0:
        q.put(out)
    dist.barrier()
    dist.destroy_process_group()


def test_fix_all_decode_is_prefill_bitwise_tp2_and_tp1(hf_dir, monkeypatch):
    monkeypatch.setenv("TPDIAG_TEST_HF_DIR", hf_dir)  # the spawned ranks inherit it
    out = gloo_world(_worker, 2, timeout=600)
    for kind, dtype in CASES:
        pre, dec = (_unbytes(*x) for x in out[f"{kind}-{dtype}"])
        iv = torch.int16 if dtype == "bfloat16" else torch.int32
        assert torch.equal(pre.view(iv), dec.view(iv)), (kind, dtype)
        # and the TP=1 prefill's bits: the fixes are TP-invariant, decode row-invariant
        pre1, _ = tp1(_spec(kind, hf_dir), dtype, "all")
        assert torch.equal(dec.view(iv), pre1.view(iv)), (kind, dtype)
    pre, dec = (_unbytes(*x) for x in out["stock"])
    assert torch.allclose(pre, dec, rtol=0, atol=1e-5) and not torch.equal(pre, dec)


@pytest.mark.parametrize("mode", ["prefill", "decode"])
def test_forward_only_worlds_build_no_autograd_graph(mode, monkeypatch):
    """A forward-only world runs its forward without autograd, as an engine does: a decode world's
    graph would otherwise chain every call through the growing KV cache and keep every call's
    saved tensors (llama-1b 1 x 2048 ran out of 80 GB on an H100)."""
    from tpdiag.config import WorldConfig
    from tpdiag.probes.recorder import Recorder
    from tpdiag.runner import determinism, step
    from tpdiag.models import tiny_llama

    seen = []
    orig = tiny_llama.TinyLlama.forward

    def spy(self, *a, **k):
        seen.append(torch.is_grad_enabled())
        return orig(self, *a, **k)

    monkeypatch.setattr(tiny_llama.TinyLlama, "forward", spy)
    determinism.setup(1234, "cpu")
    for backward in (False, True) if mode == "prefill" else (False,):
        seen.clear()
        cfg = WorldConfig.of(model="tiny-llama", degree=1, label="t", out_dir="", batch_size=1, seq_len=6,
                             backward=backward, mode=mode, probes=False, selfcheck=False)
        step.run(cfg, torch.device("cpu"), 1, Recorder())
        assert seen and set(seen) == {backward}, (mode, backward, seen)
