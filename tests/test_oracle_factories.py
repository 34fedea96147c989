"""The float64 re-execution of a module that fills a tensor it made itself with a factory given no
dtype (`torch.zeros(n, d)`: the default float32). On 2d251fd the mode left such a tensor float32, so
every later op saw a float64 COPY of it: an `index_add_` into it was refused ('writes state in place
... a float32 tensor it did not create') and a fill through a view (`load[e] = ...`: select, then
copy_) went to the copy and was lost without a word. Factories with no tensor input now make float64.
"""
import json

import torch


def test_a_module_own_accumulator_is_filled_in_float64():
    from tpdiag.probes.float64 import module_oracle

    class Accumulate(torch.nn.Module):
        def forward(self, x, idx):
            out = torch.zeros(3, x.shape[-1])
            out.index_add_(0, idx, x)
            count = torch.zeros(3)
            for i in range(3):
                count[i] = (idx == i).sum()
            return out / count.clamp(min=1)[:, None]

    x, idx = torch.randn(5, 4), torch.tensor([0, 2, 2, 1, 0])
    out, notes = module_oracle(Accumulate(), (x.double(), idx), {})
    assert out is not None, notes
    acc = torch.zeros(3, 4, dtype=torch.float64).index_add_(0, idx, x.double())
    want = acc / torch.tensor([2.0, 1.0, 2.0], dtype=torch.float64)[:, None]  # the ids' counts
    assert out.dtype == torch.float64 and torch.equal(out, want)


def test_an_moe_accumulating_in_place_is_judged_at_the_moe(moe_accum_run):
    """moe_accum.py:local_index (the experts indexed by the rank's LOCAL number): on 2d251fd the MoE's
    float64 re-execution was refused (index_add_ on its own float32 accumulator), its output's cause
    `unknown`, the BUG named downstream at the router's output grad; now a BUG at the MoE itself."""
    from tpdiag.diff.classes import leading_bug

    d, stdout = moe_accum_run  # the compare, shared with test_tamper_labels (conftest)
    e = json.loads((d / "summary.json").read_text())["degrees"]["2"]
    fd = e["first_divergence"]
    assert (fd["key"], fd["cause"]) == ("s0/forward/moe/out#0/0", "sharding-bug") and fd["oracle"]["far"], fd
    assert leading_bug(e)["key"] == fd["key"]
    assert "BUG" in stdout.splitlines()[0] and "writes state" not in stdout, stdout[-2000:]
