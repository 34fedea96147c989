"""kernels/alloc: the fixes' output buffers skip deterministic mode's NaN fill, and only them."""
import pytest
import torch

from tpdiag.kernels import alloc


@pytest.fixture
def deterministic():
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(was)


def test_fill_skipped_and_setting_restored(deterministic):
    assert torch._C._get_deterministic_fill_uninitialized_memory()
    assert torch.isnan(torch.empty(64)).all()  # the fill this helper skips is in effect here
    t = alloc.empty(64, dtype=torch.float32, device="cpu")
    alloc.empty_like(t)
    assert t.shape == (64,)
    assert torch._C._get_deterministic_fill_uninitialized_memory()  # restored
    assert torch.isnan(torch.empty(64)).all()


def test_setting_restored_when_allocation_raises(deterministic):
    with pytest.raises(RuntimeError):
        alloc.empty(-1, dtype=torch.float32, device="cpu")
    assert torch._C._get_deterministic_fill_uninitialized_memory()
