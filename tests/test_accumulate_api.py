"""The public `tpdiag.accumulate_grads` in a plain torch loop: gradient accumulation over 4
micro-batches gives the weight grads of one call over the whole batch, bit for bit (raw bits),
for the built-in tiny Llama (embedding, RMSNorms, column- and row-parallel linears, LM head);
without it (the same fixes, plain accumulation) some weight grad differs - the negative control.
TP=2 under a gloo world: the same bits as TP=1, at either micro-batch size.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

B, S = 4, 8


def _batch(vocab):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (B, S), generator=g)
    return ids, torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)


def _grads(micro: int, carry: bool, dtype=torch.float32, tp: int = 1) -> dict:
    """One step's whole weight grads (and grad norm) with `micro` sequences per piece."""
    from contextlib import nullcontext

    import tpdiag
    from torch.distributed.tensor import DTensor

    tpdiag.set_deterministic(seed=0)
    target = tpdiag.builtin_target("tiny-llama")
    model = target.model.to(dtype)
    if tp > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import loss_parallel, parallelize_module

        parallelize_module(model, init_device_mesh("cpu", (tp,)), target.plan)
    ids, labels = _batch(target.vocab_size)
    n = (labels != -100).sum()
    with tpdiag.invariant(model, target.plan, fixes="all", tree_groups=2):
        with tpdiag.accumulate_grads(model) if carry else nullcontext():
            for a in range(0, B, micro):
                logits = model(ids[a:a + micro])
                with loss_parallel() if tp > 1 else nullcontext():
                    # each piece's summed token loss over the whole batch's token count: every
                    # token's loss grad is the reference's 1/N
                    loss = F.cross_entropy(logits.flatten(0, 1), labels[a:a + micro].flatten(),
                                           reduction="sum") / n
                    loss.backward()
        norm = tpdiag.clip_grad_norm_(model.parameters(), None)

    def whole(t):
        return t.full_tensor() if isinstance(t, DTensor) else t

    out = {name: whole(p.grad).detach().clone() for name, p in model.named_parameters()}
    out["grad_norm"] = whole(norm).detach().clone().reshape(1)
    return out


def _bits(t):
    return t.contiguous().view({4: torch.int32, 2: torch.int16, 8: torch.int64}[t.element_size()])


def _differ(a: dict, b: dict) -> list[str]:
    assert a.keys() == b.keys()
    return [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(_bits(a[k]), _bits(b[k]))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_four_pieces_equal_one_bitwise(dtype):
    whole = _grads(B, True, dtype)
    assert _differ(_grads(1, True, dtype), whole) == []
    # negative control: the same fixes, grads accumulated piece by piece into .grad
    plain = _differ(_grads(1, False, dtype), _grads(B, False, dtype))
    assert any(k.endswith("weight") for k in plain), plain


def test_needs_a_carry_fix_and_a_module():
    import tpdiag

    model = tpdiag.builtin_target("tiny-llama").model
    with pytest.raises(tpdiag.BadInput, match="no fix that carries"):
        with tpdiag.accumulate_grads(model):
            pass
    with pytest.raises(tpdiag.BadInput, match="torch.nn.Module"):
        with tpdiag.accumulate_grads("model"):
            pass


def _tp2_worker(rank, world, port, q):
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    res = {f"mb{m}": _grads(m, True, tp=world) for m in (B, 1)}
    if rank == 0:
        q.put({k: {n: t.numpy() if t.dtype != torch.bfloat16 else t.float().numpy()
                   for n, t in v.items()} for k, v in res.items()})
    dist.destroy_process_group()


def test_tp2_micro_batches_equal_tp1_bitwise():
    import numpy as np

    from conftest import gloo_world

    torch.set_num_threads(1)
    ref = _grads(B, True)
    got = gloo_world(_tp2_worker, 2, timeout=240)
    for m in ("mb4", "mb1"):
        bad = [k for k in ref if not np.array_equal(ref[k].numpy().view(np.int32),
                                                     got[m][k].view(np.int32))]
        assert bad == [], (m, bad)


def test_each_grad_accumulates_once_and_its_post_accumulate_hook_sees_it_once():
    """Closing the window adds each carried grad into .grad once and runs the param's
    post-accumulate-grad hooks (tpdiag's probes record grads there) with it once - also when .grad
    already held a grad from an earlier step (accumulated onto, as autograd would). Inside the
    window autograd may run a hook with no grad yet (a carried weight's grad is None there)."""
    import tpdiag

    tpdiag.set_deterministic(seed=0)
    target = tpdiag.builtin_target("tiny-llama")
    model = target.model
    ids, labels = _batch(target.vocab_size)
    seen = {}

    def hook(p, name):
        if p.grad is not None:
            seen.setdefault(name, []).append(p.grad.clone())

    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: hook(p, name))
    with tpdiag.invariant(model, target.plan, fixes="all", tree_groups=2):
        def step():
            with tpdiag.accumulate_grads(model):
                F.cross_entropy(model(ids).flatten(0, 1), labels.flatten()).backward()
        step()
        first = {n: p.grad.clone() for n, p in model.named_parameters()}
        assert set(seen) == set(first) and all(len(v) == 1 for v in seen.values()), \
            {n: len(v) for n, v in seen.items()}
        assert all(torch.equal(seen[n][0], first[n]) for n in first)
        step()
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, first[n] + first[n]), n


def test_the_grad_probe_records_a_carried_grad_once_even_if_autograd_touches_it_in_the_window():
    """tpdiag's param-grad probe inside an accumulation window: a carried parameter's hook may run
    there with a partial grad (on an H100 with torch 2.11 a TP=2 vocab-parallel embedding's ran
    with one, and the run directory listed its grad twice). Simulated here: zeros put into .grad
    and the hooks run mid-window, as an AccumulateGrad would. The probe records the grad once,
    the window's value."""
    import tpdiag
    from tpdiag.fixes.registry import apply_fixes, resolve
    from tpdiag.kernels.tree import install_tree_groups
    from tpdiag.probes.module_probe import module_probes
    from tpdiag.probes.recorder import Recorder

    tpdiag.set_deterministic(seed=0)
    target = tpdiag.builtin_target("tiny-llama")
    model = target.model
    ids, labels = _batch(target.vocab_size)
    rec = Recorder()
    emb = model.tok_embeddings.weight
    with install_tree_groups(2), apply_fixes(resolve("all"), model=model, plan=target.plan, world=1), \
            module_probes(model, rec, plan=target.plan, backward=True):
        rec.phase = "forward"
        with tpdiag.accumulate_grads(model):
            F.cross_entropy(model(ids).flatten(0, 1), labels.flatten()).backward()
            emb.grad = torch.zeros_like(emb)  # what autograd's accumulation left inside the window
            for hook in emb._post_accumulate_grad_hooks.values():
                hook(emb)
            emb.grad = None
    from tpdiag.probes.stream import as_tensor, finish

    finish(rec.records)
    grads = [(m, as_tensor(t)) for m, t in rec.records if m["kind"] == "param_grad"]
    keys = [m["key"] for m, _ in grads]
    assert len(keys) == len(set(keys)) == len(list(model.parameters())), keys
    (m, t), = [(m, t) for m, t in grads if m["module"] == "tok_embeddings"]
    assert torch.equal(t, emb.grad)
