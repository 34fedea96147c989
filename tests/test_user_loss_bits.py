"""The step's default loss is the loss the user's trainer computes: the cross-entropy in float32 of
the logits upcast (transformers' ForCausalLMLoss, torchtitan, Megatron). It was the cross-entropy
in the logits' own dtype - for a bf16 model a bf16 loss whose backward gave other grads than the
user's (0 of a tiny Gemma2's 24), so the step tpdiag judged was not the user's step."""
import pytest
import torch
import torch.nn.functional as F

from conftest import run_cli

pytest.importorskip("transformers")


def _run(out, *args):
    p = run_cli("compare", *args, "--no-confirm", "--no-baseline", "--batch-size", "2", "--seq-len", "8",
                "--out", str(out))
    assert p.returncode == 0, p.stderr + p.stdout
    from tpdiag.records.store import RecordSet

    return lambda label: RecordSet(str(out / f"tp{label}"))


def _one(rs, kind):
    return rs.tensor(next(e for e in rs.events if e["kind"] == kind))


def test_bf16_hf_loss_and_grads_are_transformers_own(tmp_path):
    """A tiny Llama saved in bf16 with save_pretrained, one step at TP=1: the loss record is
    `model(ids, labels=ids).loss` of the user's own `from_pretrained(DIR, dtype=bfloat16)` on the
    run's batch, bit for bit, and so are the recorded parameter grads (its backward). tpdiag's
    labels are the ids shifted by one with the last position ignored: transformers' own shift."""
    from hf_configs import save_tiny_bf16_llama
    from transformers import AutoModelForCausalLM

    path = save_tiny_bf16_llama(tmp_path / "model")
    rs = _run(tmp_path / "r", "--model", "hf:" + path, "--tp", "1,1", "--dtype", "bfloat16")("1")
    batch = {e["name"]: rs.tensor(e) for e in rs.events if e["kind"] == "batch"}
    loss = _one(rs, "loss")
    grads = {f"{e['module']}.{e['name']}": rs.tensor(e) for e in rs.events if e["kind"] == "param_grad"}

    torch.set_num_threads(1)  # the worlds' ranks run on one thread (a GEMM's bits can depend on it)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    ids = batch["input_ids"]
    assert torch.equal(batch["labels"][:, :-1], ids[:, 1:]) and bool((batch["labels"][:, -1] == -100).all())
    theirs = model(ids, labels=ids)
    theirs.loss.backward()
    assert loss.dtype == theirs.loss.dtype == torch.float32
    assert torch.equal(loss, theirs.loss.detach())
    params = dict(model.named_parameters())
    assert grads and set(grads) <= set(params)
    same = [k for k, g in grads.items() if torch.equal(g, params[k].grad)]
    assert same == list(grads), f"{len(same)}/{len(grads)} recorded grads are the user's loss's"
    # negative control: the bf16 cross-entropy tpdiag ran before is another loss, with other grads
    model.zero_grad()
    logits = model(ids).logits
    old = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)
    old.backward()
    assert old.dtype == torch.bfloat16 and not torch.equal(old.float(), loss)
    assert not any(torch.equal(g, params[k].grad) for k, g in grads.items() if k.startswith("lm_head"))


def test_builtin_bf16_loss_is_float32_at_every_degree(tmp_path):
    """The built-in model in bf16 (forward only): the loss record is float32 in both worlds - at
    TP=2 the vocab-sharded logits upcast on each shard under loss_parallel - and at TP=1 it is the
    float32 cross-entropy of the recorded bf16 logits, bit for bit."""
    world = _run(tmp_path / "r", "--tp", "1,2", "--dtype", "bfloat16", "--forward-only", "--no-judge-downstream")
    for label in ("1", "2"):
        assert _one(world(label), "loss").dtype == torch.float32, label
    rs = world("1")
    logits, labels = _one(rs, "logits"), next(rs.tensor(e) for e in rs.events if e["name"] == "labels")
    assert logits.dtype == torch.bfloat16
    want = F.cross_entropy(logits.flatten(0, -2).float(), labels.flatten(), ignore_index=-100)
    assert torch.equal(_one(rs, "loss"), want)


def test_every_loss_path_is_float32_from_16_bit_logits():
    """The loss's paths on bf16 logits: the stock loss, a micro-batch piece's share, the invariant
    vocab cross-entropy and the step's loss of its pieces - float32, the stock ones the float32
    cross-entropy's bits, the invariant one within float32 rounding of it (its own summation
    order); float32 and float64 logits keep their dtype."""
    from tpdiag.kernels import vocab_ce
    from tpdiag.runner import micro
    from tpdiag.runner.losses import default_loss

    g = torch.Generator().manual_seed(0)
    z = (torch.randn(2, 6, 64, generator=g) * 3).bfloat16()
    y = torch.randint(0, 64, (2, 6), generator=g)
    y[:, -1] = -100
    want = F.cross_entropy(z.flatten(0, 1).float(), y.flatten(), ignore_index=-100)
    assert torch.equal(default_loss(z, y), want)

    class T:
        loss, vocab_size = None, 64

    n = micro.n_tokens(y)
    piece = micro.piece_loss(T, default_loss, z, z, y, n, invariant_ce=False)
    assert piece.dtype == torch.float32
    assert torch.equal(piece, F.cross_entropy(z.flatten(0, 1).float(), y.flatten(), ignore_index=-100,
                                              reduction="sum") / n)
    inv = vocab_ce.cross_entropy(z, y, 8)
    assert inv.dtype == torch.float32 and abs(float(inv) - float(want)) <= 4 * torch.finfo(torch.float32).eps * float(want)
    assert micro.piece_loss(T, None, z, z, y, n, invariant_ce=True).dtype == torch.float32
    assert micro.step_loss([vocab_ce.token_logprobs(z, y, 8)], n, z.dtype).dtype == torch.float32
    for dt in (torch.float32, torch.float64):
        assert default_loss(z.to(dt), y).dtype == dt and vocab_ce.cross_entropy(z.to(dt), y, 8).dtype == dt
        assert micro.step_loss([vocab_ce.token_logprobs(z.to(dt), y, 8)], n, dt).dtype == dt
