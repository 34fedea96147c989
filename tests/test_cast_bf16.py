"""A float32 model whose row-parallel all-reduce runs in bfloat16 at TP > 1 ("to halve the
traffic"; tests/models/planted/shard_stats.py:out_bf16, helper hbug13b), run as a user runs it.

Decided with docs/causes.md: `rounding` is a reordering of the same computation in the record's
dtype; a cast loses precision the reference keeps, so it is beyond the float32 rounding bound and
a `sharding-bug` (gate 4), as main at 80a2189 already read it - but it said only "a wrong result".
Every element of the all-reduce's output at TP=2 is a bfloat16 value and the reference's are not
(diff/bits.narrowed_to): the verdict now says it was cast, not computed wrong (fails on 80a2189:
no such words). The same model with a float32 all-reduce reads rounding only (test_shard_stats).
"""
import json

import pytest
import torch

from conftest import run_cli


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("out_bf16") / "r"
    p = run_cli("compare", "--model", "py:tests/models/planted/shard_stats.py:out_bf16", "--tp", "1,2",
                "--no-baseline", "--no-confirm", "--out", str(d), env={"OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-3000:] + p.stdout[-2000:]
    return json.loads((d / "summary.json").read_text()), p.stdout, run_cli("gate", str(d)).returncode


def test_a_bf16_all_reduce_in_a_float32_model_is_a_bug_that_says_it_was_cast(run):
    s, stdout, gate = run
    fd = s["degrees"]["2"]["first_divergence"]
    assert s["class"] == "bug" and gate == 4
    assert (fd["phase"], fd["module"], fd["cause"]) == ("forward", "ffn.sum_ranks", "sharding-bug"), fd
    assert "is a bfloat16 value and the reference's are not" in fd["why"], fd.get("why")
    assert "precision lost at this degree only" in stdout, stdout[-2000:]


def test_narrowed_to_needs_every_element_of_this_side_and_not_the_references():
    from tpdiag.diff.bits import narrowed_to

    g = torch.Generator().manual_seed(0)
    a = torch.randn(64, generator=g)
    assert narrowed_to(a, a.to(torch.bfloat16).float()) == "bfloat16"
    assert narrowed_to(a, a.half().float()) == "float16"
    # a reordering keeps float32's precision: no cast
    assert narrowed_to(a, a * (1 + 2 ** -23)) is None
    # the reference a bfloat16 value too (a model that keeps its weights in bfloat16): no cast here
    b = a.to(torch.bfloat16).float()
    assert narrowed_to(b, (b * 2).to(torch.bfloat16).float()) is None
    # one element not a bfloat16 value: no
    c = a.to(torch.bfloat16).float()
    c[3] = a[3]
    assert narrowed_to(a, c) is None


def test_narrowed_to_reads_no_whole_record_when_its_leading_elements_rule_a_cast_out():
    """Every divergent record is asked (diff/measure.measure_pair); a float32 reordering's values are of
    no narrower dtype, which its first elements already show. Reviewer hreview13: on c8df0f6 each such
    record took a dozen whole-tensor passes here (`b != 0`, `a != 0`, isfinite, two round trips through
    bfloat16 and float16) - half again compare()'s own cost on a 4M-element record. Counted with a
    dispatch mode: no op may touch more elements than the probe."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    from tpdiag.diff.bits import NARROW_PROBE, narrowed_to

    class Widest(TorchDispatchMode):
        most = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten((args, kwargs or {}, out))[0]:
                if isinstance(t, torch.Tensor) and func is not torch.ops.aten.view.default \
                        and func is not torch.ops.aten.slice.Tensor:
                    self.most = max(self.most, t.numel())
            return out

    g = torch.Generator().manual_seed(0)
    a = torch.randn(1 << 16, generator=g)
    b = a * (1 + 2 ** -20)
    with Widest() as w:
        assert narrowed_to(a, b) is None
    assert w.most <= NARROW_PROBE, w.most
    # a cast is still found: the probe only rules out
    assert narrowed_to(a, a.to(torch.bfloat16).float()) == "bfloat16"
