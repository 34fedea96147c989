"""Mistakes in a user's PARALLEL code (tests/models/planted/parallel_code.py), each beside its
correct twin, run as a user runs them: `tpdiag compare py:... --tp 1,2`, then `tpdiag gate`.

- mega_ok: Megatron's Column/RowParallelLinear written by hand, each rank holding only its SHARD of
  the weights (plain tensors). Correct - yet main at c4d0501 read BUG, `optimizer: grad_norm
  total, rank-inconsistent-replica` (gate exit 4): tpdiag's own grad norm counted a plain shard's
  norm as a replica's, so each rank clipped by its own local norm and the replicas drifted at the
  step. A plain grad whose values differ between the ranks is now a shard: its norm is the ranks'
  norms' norm (runner/losses.py shard_norms). The same with `--fix all` (invariant-grad-norm's
  kernel took each rank's plain shard as a whole grad).
- mega_dgrad: the column layer's own autograd Function forgets the input grad's all-reduce: the
  forward is exact, BUG in backward, named at the grad returned by mlp.up's backward.
- mega_bias: the row-parallel layer adds its bias on every rank before the all-reduce: BUG there.
- embed_last: a vocab-parallel embedding masking each shard's last id: BUG at embed in forward.
- split_loss_mean: the loss split over the ranks by positions, each rank's MEAN over its unmasked
  tokens averaged over the ranks (uneven counts: the prompt is masked): BUG at the loss.
- plan_local_norm: a `{fqn: style}` plan leaving the up projection column-sharded before a
  non-affine LayerNorm over the whole hidden width: BUG at that norm's op. Its twin gathers first.
"""
import json

import pytest
import torch
import torch.distributed as dist

from conftest import gloo_world, run_cli

SPEC = "py:tests/models/planted/parallel_code.py:"
CASES = {c: (c, ()) for c in ("embed_last", "split_loss_mean", "split_loss_ok", "mega_dgrad", "mega_bias", "mega_ok",
                               "plan_local_norm", "plan_gather")}
# under invariant-grad-norm the kernel took each rank's plain shard as a whole grad: the same BUG
CASES["mega_ok_fix_all"] = ("mega_ok", ("--fix", "all"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for case, (func, more) in CASES.items():
        d = tmp_path_factory.mktemp(case) / "r"
        p = run_cli("compare", "--model", SPEC + func, "--tp", "1,2", "--no-baseline", "--no-confirm", *more,
                    "--out", str(d), env={"OMP_NUM_THREADS": "1"})
        assert p.returncode == 0, (case, p.stderr[-3000:] + p.stdout[-2000:])
        out[case] = (json.loads((d / "summary.json").read_text()), p.stdout, run_cli("gate", str(d)).returncode)
    return out


def _lead(s):
    from tpdiag.diff.classes import leading_bug

    return leading_bug(s["degrees"]["2"])


@pytest.mark.parametrize("case", ["split_loss_ok", "mega_ok", "mega_ok_fix_all", "plan_gather"])
def test_the_twins_are_rounding_only(runs, case):
    s, stdout, gate = runs[case]
    assert s["class"] == "rounding" and not s["degrees"]["2"].get("findings"), (case, s["degrees"]["2"].get("findings"))
    assert "BUG" not in stdout and gate == 1, (case, gate, stdout[-1500:])  # divergent, never 4


@pytest.mark.parametrize("case,where", [
    ("embed_last", ("forward", "embed", "out", "sharding-bug")),
    ("mega_dgrad", ("backward", "embed", "grad_out", "rank-inconsistent-replica")),
    ("split_loss_mean", ("loss", "model", "loss", "sharding-bug")),
    ("mega_bias", ("forward", "mlp.down", "out", "sharding-bug")),
    # the norm is in ffn's own forward: the wrong record is ffn.down's input, made in ffn
    ("plan_local_norm", ("forward", "ffn", "in", "sharding-bug")),
])
def test_a_mistake_in_the_parallel_code_is_a_bug_where_it_sits(runs, case, where):
    s, stdout, gate = runs[case]
    lead = _lead(s)
    assert s["class"] == "bug" and lead is not None, (case, s["degrees"]["2"].get("findings"))
    assert (lead["phase"], lead["module"], lead["kind"], lead["cause"]) == where, (case, lead)
    assert gate == 4, case


def test_a_column_layers_forgotten_dgrad_reduce_names_its_backward(runs):
    s, stdout, _ = runs["mega_dgrad"]
    lead = _lead(s)
    assert lead["consumers"] == ["mlp", "mlp.up"], lead
    assert "backward: embed (grad_out 0), returned by the backward of mlp, mlp.up" in stdout, stdout


def test_the_plan_mistake_is_named_at_the_norms_op(runs):
    s, stdout, _ = runs["plan_local_norm"]
    assert _lead(s)["op"] == "aten::native_layer_norm", _lead(s)
    assert "BUG (a wrong result, not rounding) at TP=2 forward: ffn :: aten::native_layer_norm" in stdout, stdout


def _norms(rank, world, port, q):
    import os
    from types import SimpleNamespace

    from torch.utils._python_dispatch import TorchDispatchMode

    from tpdiag.kernels import grad_norm as gn
    from tpdiag.runner import losses

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    g = torch.Generator().manual_seed(0)
    shard, rep, only0 = torch.randn(8, 3, generator=g), torch.randn(5, generator=g), torch.randn(4, generator=g)
    params = [SimpleNamespace(grad=shard[rank * 4:(rank + 1) * 4].clone()),  # each rank its rows
              SimpleNamespace(grad=rep.clone()),  # a replica: the same grad on both ranks
              SimpleNamespace(grad=only0.clone() if rank == 0 else None)]  # used on rank 0 only
    invariant = losses._with_plain_shards(gn.grad_norm_and_clip)
    got = {"stock": losses.grad_norm_and_clip(params, None), "invariant": invariant(params, None),
           # negative control: each grad taken as whole on its rank (what both did before)
           "local": gn.grad_norm_and_clip(params, None).float()}
    out = {}
    for k, t in got.items():
        every = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(every, t)
        out[k] = [e.item() for e in every]
    # the replicas alone (no plain shard): the kernel's own bits, the wrapper adds nothing
    reps = [SimpleNamespace(grad=rep.clone()), SimpleNamespace(grad=rep[:2].clone())]
    out["reps_same"] = torch.equal(invariant(reps, None), gn.grad_norm_and_clip(reps, None))
    # the ops the shard check runs, seen by a dispatch mode (as an op probe sees them)
    for name, fn in (("shipped", losses.shard_norms), ("inner", losses._shard_norms)):
        with Count() as c:
            found = fn(params[:2], torch.float32)
        out[name] = (len(c.ops), len(found))
    if rank == 0:
        out["whole"] = torch.linalg.vector_norm(torch.cat([shard.flatten(), rep, only0]).double()).item()
        q.put(out)
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def norms():
    return gloo_world(_norms, 2)


def test_plain_shards_are_normed_over_the_ranks_and_replicas_once(norms):
    got = norms
    for k in ("stock", "invariant"):
        a, b = got[k]
        assert a == b, (k, got)  # the same norm, so the same clip, on every rank
        assert a == pytest.approx(got["whole"], rel=1e-6), (k, got)
    assert got["local"][0] != got["local"][1], got
    assert got["reps_same"]


def test_the_shard_check_adds_no_op_to_the_optimizer_phase(norms):
    # an op probe numbers the optimizer's ops per kind; the check runs at TP > 1 only, so ops of its
    # own would shift every later op record against TP=1's (--granularity op): it records none
    got = norms
    assert got["shipped"] == (0, 1), got  # no op seen, the shard still found
    assert got["inner"][0] > 0 and got["inner"][1] == 1, got  # negative control: the same work, seen


def test_logits_of_each_ranks_positions_are_refused_in_one_line(tmp_path):
    """A model sequence-parallel to its head returns each rank's positions' logits. tpdiag's own
    logprobs need every position's: main at c4d0501 failed the world with F.cross_entropy's words
    ("ValueError: Expected input batch_size (8) to match target batch_size (16)"), naming nothing."""
    p = run_cli("compare", "--model", SPEC + "seq_logits", "--tp", "1,2", "--no-baseline", "--no-confirm",
                "--forward-only", "--out", str(tmp_path / "r"), env={"OMP_NUM_THREADS": "1"})
    assert p.returncode == 2, p.stdout[-2000:] + p.stderr[-2000:]
    assert "rank 0 raised BadInput: the model returned logits of shape (2, 4, 32), 8 positions (16 over the 2 " \
           "ranks: each rank's own positions?), for labels of shape (2, 8)" in p.stdout, p.stdout[-2000:]
    assert "gather sequence- or context-parallel logits" in p.stdout
