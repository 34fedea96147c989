"""tree_sum_stacked_to: the top of the cross-rank tree with the rounding fused into its last add
is the same bits as the tree in fp32 then one cast (CPU here; on CUDA torch.add(out=bf16) is one
kernel that adds in fp32 and rounds on the store). Negative control: rounding each rank's
partial before the add is other bits."""
import pytest
import torch

from tpdiag.kernels.tree import tree_sum_stacked, tree_sum_stacked_to

DEVS = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("dev", DEVS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_tree_sum_stacked_to_is_tree_then_cast(dev, dtype):
    gen = torch.Generator().manual_seed(0)
    for w in (1, 2, 4, 8):
        t = (torch.randn(w, 4099, generator=gen) * torch.logspace(-3, 3, 4099)).to(dev)
        got = tree_sum_stacked_to(t, dtype)
        want = tree_sum_stacked(t).to(dtype)
        assert got.dtype == dtype and torch.equal(got.view(torch.int16), want.view(torch.int16)), w
        if w > 1:
            early = tree_sum_stacked(t.to(dtype).float()).to(dtype)
            assert not torch.equal(got.view(torch.int16), early.view(torch.int16)), w
    assert torch.equal(tree_sum_stacked_to(t, torch.float32).view(torch.int32),
                       tree_sum_stacked(t).view(torch.int32))
