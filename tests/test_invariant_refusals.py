"""`tpdiag.invariant` refuses what cannot work, with nothing left installed: a plan that names
none of the sharded modules of a parallelized model (plan={} was a silent loss of bitwise
equality), an empty fix list, a second block inside an open one, and values of the wrong type
(a BadType: a BadInput that is also a TypeError, saying which type it must be)."""
from __future__ import annotations

import re

import pytest
import torch
from torch import nn


def _tiny():
    torch.manual_seed(0)
    m = nn.Sequential()
    m.add_module("up", nn.Linear(8, 32))
    m.add_module("down", nn.Linear(32, 16))
    return m, {"up": "colwise", "down": "rowwise"}


@pytest.mark.parametrize("kwargs,needle", [
    (dict(tree_groups="2"), "tree_groups='2': must be an int (a power of two >= 1, e.g. 8), not str"),
    (dict(tree_groups=2.0), "tree_groups=2.0: must be an int"),
    (dict(tree_groups=True), "tree_groups=True: must be an int"),
    (dict(tree_groups=2, fixes=3), "fixes=3: must be 'all', 'none', a fix name or a list of them, not int"),
    (dict(tree_groups=2, fixes=[None]), "every fix must be a name (str)"),
    (dict(tree_groups=2, group_gemm=1), "group_gemm=1: must be a str"),
    (dict(tree_groups=2, deterministic="yes"), "deterministic='yes': must be True or False, not str"),
])
def test_wrong_types_are_a_type_error_that_says_the_type(kwargs, needle):
    import tpdiag

    model, plan = _tiny()
    with pytest.raises(tpdiag.BadType, match=re.escape(needle)) as e:
        with tpdiag.invariant(model, plan, **kwargs):
            pass
    assert isinstance(e.value, TypeError) and isinstance(e.value, tpdiag.BadInput)
    assert "forward" not in model.up.__dict__
    with pytest.raises(tpdiag.BadType, match="plan: expected"):
        with tpdiag.invariant(model, [("up", "colwise")], tree_groups=2):
            pass
    with pytest.raises(tpdiag.BadType, match="max_norm='1': must be a number"):
        tpdiag.clip_grad_norm_(model.parameters(), "1")


@pytest.mark.parametrize("fixes", [[], "", ()])
def test_an_empty_fix_list_is_refused(fixes):
    import tpdiag

    model, plan = _tiny()
    with pytest.raises(tpdiag.BadInput, match="no fix named"):
        with tpdiag.invariant(model, plan, fixes=fixes, tree_groups=2):
            pass
    with tpdiag.invariant(model, plan, fixes="none"):  # explicit: determinism only
        assert "forward" not in model.up.__dict__


def test_nesting_is_refused_and_the_outer_block_stays_whole():
    import tpdiag

    model, plan = _tiny()
    other, _ = _tiny()
    with tpdiag.invariant(model, plan, tree_groups=2):
        for m in (model, other):
            with pytest.raises(tpdiag.BadInput, match="do not nest"):
                with tpdiag.invariant(m, plan, tree_groups=2):
                    pass
        assert "forward" in model.up.__dict__ and torch.are_deterministic_algorithms_enabled()
        assert "forward" not in other.up.__dict__
    assert "forward" not in model.up.__dict__
    with tpdiag.invariant(model, plan, tree_groups=2):  # closed: a new block opens again
        pass


def _plan_worker(rank, world, port, q):
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import tpdiag

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model, _ = _tiny()
    plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
    parallelize_module(model, init_device_mesh("cpu", (world,)), plan)
    msgs = []
    # {}: the plan forgotten; {"": ...}: a key that matches a module (the root), but no sharded one
    for bad in ({}, {"": "colwise"}):
        try:
            with tpdiag.invariant(model, bad, tree_groups=2):
                msgs.append("accepted")
        except tpdiag.BadInput as e:
            msgs.append(str(e))
    with tpdiag.invariant(model, plan, tree_groups=2):  # the real plan: accepted
        msgs.append("ok")
    if rank == 0:
        q.put(msgs)
    dist.destroy_process_group()


def test_a_plan_naming_no_sharded_module_is_refused():
    from conftest import gloo_world

    msgs = gloo_world(_plan_worker, 2, timeout=120)
    assert msgs[-1] == "ok", msgs
    for m in msgs[:2]:
        assert "plan: names none of the 2 modules with sharded DTensor parameters (e.g. up, down)" in m, m
