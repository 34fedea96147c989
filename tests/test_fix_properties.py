"""A fix's properties live in its catalogue entry (fixes/catalogue.py): a fix added to the
catalogue - here, in the test, with no list anywhere else touched - runs with tree groups, the
fp32 carry, the batch-invariant confirmation and the runner's switches, because everything
outside the fix asks by property. The negative control: the same fix without the properties
gets none of them. And no module outside tpdiag/fixes/ names a fix to test it.
"""
import ast
import os
from contextlib import contextmanager

import pytest
import torch
from conftest import ROOT

from tpdiag.errors import BadInput


@pytest.fixture
def toy(monkeypatch):
    """Registers `toy-fix` with the given properties; returns a log of its install / user_install."""
    from tpdiag.fixes.catalogue import FIXES, Fix

    log = []

    def add(**props):
        @contextmanager
        def cm(what):
            log.append(what + " in")
            yield
            log.append(what + " out")

        fix = Fix("toy-fix", ("toy-cause",), ("toy op",), "free",
                  lambda model, plan, world: cm("install"),
                  user_install=(lambda: cm("user")) if props.pop("user", False) else None, **props)
        monkeypatch.setitem(FIXES, "toy-fix", fix)
        return fix

    add.log = log
    return add


ALL = dict(grouped=True, batch_invariant=99, carries_grads=True, takes_over=("grad-norm",), user=True)


def _tiny():
    from torch import nn
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
    return model, {"0": ColwiseParallel(), "1": RowwiseParallel()}


def _effects(names=("toy-fix",)) -> dict:
    """What the rest of tpdiag does with `names` on, read through the code that acts on it."""
    from types import SimpleNamespace

    import tpdiag
    from tpdiag.api.invariant import check_groups
    from tpdiag.fixes import groups, registry
    from tpdiag.kernels import grad_carry
    from tpdiag.runner import losses, micro

    out = {"uses_groups": groups.uses_groups(names),
           "batch_confirm": "toy-fix" in registry.fixes_for_cause("batch-variant-kernel"),
           "all": "toy-fix" in registry.resolve("all")}
    try:
        check_groups(None, 2, names)
        out["needs_g"] = False
    except BadInput as e:
        out["needs_g"] = "tree_groups: required with toy-fix" in str(e)
    try:
        groups.check((1, 3), names)
        out["pow2_refused"] = False
    except BadInput as e:
        out["pow2_refused"] = "TP=3 with toy-fix" in str(e)
    cfg = SimpleNamespace(backward=True, fixes=tuple(names), micro_batch=None)
    out["carry_window"] = micro.carry_window(cfg, [None], torch.device("cpu")) is grad_carry.window
    model, plan = _tiny()
    model(torch.randn(3, 8)).sum().backward()
    with tpdiag.invariant(model, plan, fixes=list(names), tree_groups=2 if out["needs_g"] else None):
        out["norm_swapped"] = losses.step_functions(SimpleNamespace(loss=None, vocab_size=4))[2].__module__ \
            == "tpdiag.kernels.grad_norm"
        # the public clip: the invariant one returns its float64 norm, the stock one float32
        out["clip_dtype"] = tpdiag.clip_grad_norm_(model.parameters(), None).dtype
        try:
            with tpdiag.accumulate_grads(model):
                pass
            out["accumulate"] = True
        except BadInput:
            out["accumulate"] = False
    out["after"] = registry.takes_over("grad-norm") or registry.carrying()
    return out


def test_a_new_fix_gets_its_properties_without_any_list(toy):
    toy(**ALL)
    got = _effects()
    assert got == {"uses_groups": True, "batch_confirm": True, "all": True, "needs_g": True,
                   "pow2_refused": True, "carry_window": True, "norm_swapped": True,
                   "clip_dtype": torch.float64, "accumulate": True, "after": False}, got
    # installed as every fix is, and its user-loop part entered inside tpdiag.invariant
    assert toy.log == ["install in", "user in", "user out", "install out"]


def test_negative_control_the_same_fix_without_properties(toy):
    toy()
    got = _effects()
    assert got == {"uses_groups": False, "batch_confirm": False, "all": True, "needs_g": False,
                   "pow2_refused": False, "carry_window": False, "norm_swapped": False,
                   "clip_dtype": torch.float32, "accumulate": False, "after": False}, got
    assert toy.log == ["install in", "install out"]


def test_the_catalogue_properties_are_what_the_name_lists_were():
    """The derived sets equal the hand-written tuples they replace, in order (a confirm
    directory's name joins the batch-invariant set)."""
    from tpdiag.fixes import registry

    assert registry.grouped() == ("tp-invariant-linear", "invariant-gemm", "invariant-vocab-softmax",
                                  "invariant-norm-grad")
    assert registry.carry_fixes() == ("invariant-gemm", "invariant-norm-grad")
    assert registry.fixes_for_cause("batch-variant-kernel") == (
        "invariant-gemm", "tp-invariant-linear", "invariant-attention", "invariant-norm-grad",
        "invariant-vocab-softmax")


def test_a_bad_property_is_refused_at_registration():
    from tpdiag.fixes.catalogue import Fix

    with pytest.raises(ValueError, match="installs='patch'"):
        Fix("x", (), (), "", installs="patch")
    with pytest.raises(ValueError, match="takes_over \\['optimizer'\\]"):
        Fix("x", (), (), "", takes_over=("optimizer",))


def test_no_module_outside_the_fixes_names_a_fix_to_test_it():
    """A fix name as a whole string constant (`"invariant-gemm" in cfg.fixes`,
    `state.active("...")`) outside tpdiag/fixes/ is a property read by name: it must ask the
    catalogue instead (fixes/registry.py)."""
    from tpdiag.fixes.registry import catalogue

    names = set(catalogue())
    pkg = os.path.join(ROOT, "tpdiag")
    hits = []
    for d, _, files in os.walk(pkg):
        if os.path.relpath(d, pkg).split(os.sep)[0] == "fixes":
            continue
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(d, f)
                for n in ast.walk(ast.parse(open(path).read(), path)):
                    if isinstance(n, ast.Constant) and n.value in names:
                        hits.append(f"{os.path.relpath(path, ROOT)}:{n.lineno}: {n.value!r}")
                    if isinstance(n, ast.Attribute) and n.attr == "active" \
                            and isinstance(n.value, ast.Name) and n.value.id == "state":
                        hits.append(f"{os.path.relpath(path, ROOT)}:{n.lineno}: state.active")
    assert not hits, hits
