"""A pretraining team's torchtitan-style Llama under torch's own `parallelize_module` plan
(tests/models/user_tt25.py), each FUNC the team's trainer with one TP mistake of its own, run as the
team runs it: `tpdiag compare --model py:... --tp 1,2`, then `tpdiag gate`. One compare per case.

- ok, ok_nosp, zloss_ok: the sequence-parallel and plain plans, and a z-loss on the gathered logits,
  correct: rounding only, gate --allow rounding 0.
- head_replicated: correct, the head's logits a replicated DTensor (`output_layouts=Replicate(),
  use_local_output=False`), the team's loss gathering them: rounding only. Main at 9eb8e34 failed
  every TP=2 rank in tpdiag's own logprobs (loss_parallel() refuses a DTensor not cut along the vocab).
- norm_grad_local: the team's fused RMSNorm kernel (an autograd Function on `to_local()` shards)
  under SequenceParallel, the weight's grad never summed over the ranks' positions: BUG at the
  first weight grad the backward makes, `norm`'s, `rank-inconsistent-replica`.
- double_reduce: Megatron's reduce kept on a RowwiseParallel output: BUG at the MLP's forward, "every
  element is 2x the reference's" (main at 9eb8e34 gave only the float64 distance, 1.00e+00).
- loss_world: the loss divided by the world size: BUG at the loss, "the loss is 1/2 x the reference's"
  (main at 9eb8e34: no reason; a scalar has no one-factor fit, diff/scale.whole_factor).
- data_rank_seed: the batch drawn per rank from a sampler seeded by the global rank: BUG at the batch.
- data_rank_shard: the batch split over the world's ranks (a DistributedSampler given the global rank):
  BUG at the batch, saying each rank must get the whole batch. Main at 9eb8e34 gathered the ranks'
  rows as a batch-dim shard (bitwise the reference's batch) and named `tok_embeddings`' output,
  blaming "an input layout your plan declares wrongly".
- logit_scale: a learned 0-dim query temperature, a plain parameter on the column-parallel q: BUG
  at its grad (the last layer's: the backward's first), `rank-inconsistent-replica`, shares that add up.
- mlp_local: the MLP left out of the sequence-parallel plan, run on each rank's own positions: BUG at
  its weights' grads (the last layer's w2 first), each rank's positions' share.
- zloss_split: that z-loss's coefficient divided by the TP degree ("every rank adds it"): BUG at the
  loss (45x beyond its bound; not a whole factor of it).
- label_smooth: label smoothing under torch's loss_parallel, which does not support it: every TP=2
  rank raises in the team's loss; the world failed (gate 2), named at the team's line, with where a
  DTensor meets a plain tensor in a Target.loss (loss_parallel) and what to do (main at 9eb8e34: none).
- zloss: a z-loss from `torch.logsumexp` of the loss-parallel logits: TP=2 raises in loss.backward()
  (DTensor and Tensor mixed); the failure says it came from the backward pass.
"""
import json

import pytest

from conftest import run_cli

FAILS = ("label_smooth", "zloss")  # a world that failed is inconclusive: compare exits 2


class Runs(dict):
    """Each case's compare, made at its first use (a test selected alone runs its own only):
    (summary.json, stdout, `gate --allow rounding`'s exit code, its output)."""

    def __init__(self, tmp_path_factory):
        super().__init__()
        self.tmp = tmp_path_factory

    def __missing__(self, case):
        d = self.tmp.mktemp(case) / "r"
        p = run_cli("compare", "--model", f"py:tests/models/user_tt25.py:{case}", "--tp", "1,2",
                    "--no-baseline", "--no-confirm", "--out", str(d), env={"OMP_NUM_THREADS": "1"})
        assert p.returncode == (2 if case in FAILS else 0), (case, p.stderr[-3000:] + p.stdout[-2000:])
        g = run_cli("gate", str(d), "--allow", "rounding")
        self[case] = (json.loads((d / "summary.json").read_text()), p.stdout, g.returncode, g.stdout + g.stderr)
        return self[case]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return Runs(tmp_path_factory)


@pytest.mark.parametrize("case", ["ok", "ok_nosp", "zloss_ok", "head_replicated"])
def test_the_correct_plans_read_rounding_only(runs, case):
    s, stdout, gate, gate_out = runs[case]
    e = s["degrees"]["2"]
    assert s["class"] == "rounding" and not e.get("findings"), (case, e)
    assert e["first_divergence"]["cause"] == "row-parallel-reduction", e["first_divergence"]
    assert "BUG" not in stdout and gate == 0, (case, gate_out, stdout[-1500:])


@pytest.mark.parametrize("case,where,cause,said", [
    ("norm_grad_local", ("backward", "norm", "param_grad", "weight"), "rank-inconsistent-replica",
     "backward: norm (param_grad weight)"),
    ("double_reduce", ("forward", "layers.0.feed_forward", "out", "0"), "sharding-bug",
     "forward: layers.0.feed_forward"),
    ("loss_world", ("loss", "model", "loss", "loss"), "sharding-bug", "loss: the loss function"),
    ("data_rank_seed", ("init", "model", "batch", "input_ids"), "rank-inconsistent-replica",
     "init: batch input_ids"),
    ("data_rank_shard", ("init", "model", "batch", "input_ids"), "sharding-bug", "init: batch input_ids"),
    ("logit_scale", ("backward", "layers.1.attention", "param_grad", "logit_scale"), "rank-inconsistent-replica",
     "backward: layers.1.attention (param_grad logit_scale)"),
    ("zloss_split", ("loss", "model", "loss", "loss"), "sharding-bug", "loss: the loss function"),
    ("mlp_local", ("backward", "layers.1.feed_forward.w2", "param_grad", "weight"), "rank-inconsistent-replica",
     "backward: layers.1.feed_forward.w2 (param_grad weight)"),
])
def test_each_mistake_is_a_bug_at_its_record(runs, case, where, cause, said):
    from tpdiag.diff.classes import leading_bug

    s, stdout, gate, gate_out = runs[case]
    lead = leading_bug(s["degrees"]["2"])
    assert s["class"] == "bug" and lead is not None, (case, s["degrees"]["2"])
    assert (lead["phase"], lead["module"], lead["kind"], lead["name"], lead["cause"]) == (*where, cause), lead
    assert f"BUG (a wrong result, not rounding) at TP=2 {said}" in stdout, stdout
    assert gate == 4, (case, gate_out)
    if case in ("norm_grad_local", "logit_scale", "mlp_local"):  # each rank kept its own share of the weight's grad
        assert lead.get("partial_sum") is True, lead
    if case == "loss_world":  # the loss exactly 1/TP of the reference's: a count, said so
        assert lead["why"].startswith("the loss is 1/2 x the reference's, to within its rounding bound"), lead
        assert "a mean over the world size" in stdout, stdout[-2000:]
    if case == "double_reduce":  # the MLP's output reduced twice: 2x, said beside the float64 verdict
        assert abs(lead["far_scale"] - 2) < 1e-3 and lead["why"].startswith("every element is 2x"), lead
        assert "a reduction applied twice" in stdout, stdout[-2000:]
    if case == "data_rank_shard":
        assert "each rank's batch has shape [1, 8], the reference's [2, 8]" in lead["why"], lead
        assert "must get the whole batch" in lead["why"], lead


def test_label_smoothing_under_loss_parallel_fails_at_the_users_line(runs):
    s, stdout, gate, _ = runs["label_smooth"]
    e = s["degrees"]["2"]
    assert e["status"] == "failed" and s["class"] is None, e
    assert "user_tt25.py" in stdout and "in cross_entropy_smoothed" in stdout, stdout[-2000:]
    assert "gather the DTensor with .full_tensor() first" in stdout, stdout[-2000:]
    assert gate == 2, gate


def test_a_failure_in_the_backward_says_so(runs):
    # the z-loss's logsumexp over the loss-parallel logits raises in loss.backward(): no frame of
    # anyone's code is on the stack; main at 9eb8e34 said "rank 0 raised RuntimeError: aten.mul..."
    s, stdout, gate, _ = runs["zloss"]
    assert s["degrees"]["2"]["status"] == "failed" and gate == 2, s["degrees"]["2"]
    line = next(ln for ln in stdout.splitlines() if ln.startswith("2 ") and "failed" in ln)
    assert "rank 0 raised RuntimeError (from the backward pass: loss.backward()" in line, line
    assert "got mixed torch.Tensor and DTensor" in line and "loss_parallel()" in line, line


def test_fix_all_makes_the_correct_plan_bitwise(tmp_path):
    # the team's loss is F.cross_entropy on loss-parallel logits: under --fix all it goes through
    # invariant-vocab-softmax as the docs say; main at 9eb8e34 kept torch's vocab-parallel softmax
    # for a Target.loss in compare (the mode was installed only by tpdiag.invariant): 1 ULP at the loss
    d = tmp_path / "r"
    p = run_cli("compare", "--model", "py:tests/models/user_tt25.py:ok", "--tp", "1,2", "--fix", "all",
                "--no-baseline", "--no-confirm", "--out", str(d), env={"OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-3000:] + p.stdout[-2000:]
    s = json.loads((d / "summary.json").read_text())
    assert s["degrees"]["2"]["status"] == "bitwise", s["degrees"]["2"].get("first_divergence")
    assert run_cli("gate", str(d)).returncode == 0
