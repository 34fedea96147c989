"""probes/float64_args.py: the float64 oracle's own walk of an op's arguments gives what pytree's
gives - the same tensors in the same order, the same structure with float64 copies - for every
container an op passes or returns (lists, tuples, dicts, torch.Size, a structseq like
torch.return_types.max, nested), so the oracle's verdicts are unchanged."""
import torch
from torch.utils._pytree import tree_flatten, tree_map

from tpdiag.probes.float64_args import _map_args, _tensors, _upcast_one


def _cases():
    f, h, i = torch.randn(3), torch.randn(2, 2).half(), torch.arange(4)
    c = torch.randn(2, dtype=torch.complex64)
    top = torch.max(torch.randn(3, 4), 1)  # a structseq (tuple subclass) of two tensors
    return [
        (f, 2, None, [h, i, (c, 1.5)], torch.Size([3, 4]), torch.float32),
        {"weight": h, "bias": None, "dims": [0, 1], "out": (f, {"x": i})},
        (top, [top, f]),
        (),
        [[], {}, ()],
    ]


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _agrees(tensors, map_args) -> bool:
    for case in _cases():
        want = [t for t in tree_flatten(case)[0] if isinstance(t, torch.Tensor)]
        got = tensors(case, [])
        if len(got) != len(want) or not all(g is w for g, w in zip(got, want)):
            return False
        if not _same(map_args(_upcast_one, case), tree_map(_upcast_one, case)):
            return False
    return True


def test_the_walk_is_pytrees():
    assert _agrees(_tensors, _map_args)
    case = _cases()[0]
    up = _map_args(_upcast_one, case)
    assert up[0].dtype == torch.float64 and up[3][0].dtype == torch.float64 and up[3][1].dtype == torch.int64
    assert up[3][2][0].dtype == torch.complex128
    assert type(up[4]) is type(tree_map(_upcast_one, case)[4])  # torch.Size: as pytree leaves it


def test_negative_control_a_walk_of_exact_containers_only_is_caught():
    """Without the fallback to pytree a structseq (torch.max's result) is a leaf: its tensors
    are missed - the check above tells."""
    def tensors(x, out):
        if type(x) in (tuple, list):
            for v in x:
                tensors(v, out)
        elif type(x) is dict:
            for v in x.values():
                tensors(v, out)
        elif isinstance(x, torch.Tensor):
            out.append(x)
        return out

    assert not _agrees(tensors, _map_args)
