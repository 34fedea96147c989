"""models/meta_fills.meta_device: the CLI's plan check builds a `py:` target on meta (models/precheck.py);
there an init's random fill has no values to write, but torch ran it through torch._refs.normal,
whose first call imports torch._dynamo and torch._inductor in the CLI process. Inside meta_device the
fills of meta tensors are skipped; a fill of a tensor on another device is torch's own, bit for bit."""
import subprocess
import sys

from conftest import ROOT

SCRIPT = r"""
import sys
import torch
from torch import nn
from tpdiag.models.meta_fills import meta_device

assert "torch._dynamo" not in sys.modules
with meta_device():
    m = nn.Sequential(nn.Embedding(11, 8), nn.Linear(8, 6), nn.LayerNorm(6))
    nn.init.trunc_normal_(m[1].weight, std=0.02)
    m[0].weight.data.normal_()
    torch.manual_seed(3)
    kept = torch.empty(4, 5, device="cpu").normal_()  # not on meta: filled as torch fills it
    ones = torch.ones(3)
assert all(p.is_meta for p in m.parameters()) and ones.is_meta
assert [tuple(p.shape) for p in m.parameters()] == [(11, 8), (6, 8), (6,), (6,), (6,)]
torch.manual_seed(3)
assert torch.equal(kept, torch.empty(4, 5).normal_())
print("skipped", "torch._dynamo" in sys.modules)
with torch.device("meta"):  # the control: torch's own meta build of the same modules
    nn.Sequential(nn.Embedding(11, 8), nn.Linear(8, 6), nn.LayerNorm(6))
print("plain", "torch._dynamo" in sys.modules)
"""


def test_a_meta_build_skips_the_fills_that_imported_dynamo():
    p = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    # the negative control's line: a plain meta build of the same modules still imports it
    assert p.stdout.split() == ["skipped", "False", "plain", "True"], p.stdout + p.stderr[-2000:]
