"""Causes found by the Hugging Face zoo run, on synthetic records (pure diff code, no worlds).

- `shape-dependent-kernel`: an elementwise activation whose inputs are bitwise equal gives other
  bits on a narrower strided shard (CPU: vectorised body vs scalar tail) - tiny DeepSeek-V3 and
  AFMoE at TP=4, `experts.act_fn`. Named only within a few ULP; a larger difference or unequal
  inputs are not named.
- a rank-partial replica (Apertus' XIELU `alpha_p`/`alpha_n`: replicated parameters whose grads
  each rank sums over its own columns, never all-reduced): the finding says the ranks' copies
  add up to the reference, and the optimizer findings it caused point back to it.
"""
import pytest
import torch

from tpdiag.diff import bits, generic_bound
from tpdiag.diff.engine import DegreeDiff
from tpdiag.diff.partials import partial_sum as _partial_sum
from tpdiag.diff.locate import classify, locate

KEY = "s0/forward/experts.act_fn/out#0/0"
IN = "s0/forward/experts.act_fn/in#0/0"


def _silu_rows(x: torch.Tensor, width: int) -> torch.Tensor:
    """SiLU of x's columns in blocks of `width`, each block a strided view (rows of `width`
    floats inside a buffer twice as wide), as an MoE expert's gate half of gate_up."""
    out = []
    for c in range(0, x.shape[1], width):
        buf = torch.cat([x[:, c:c + width], torch.zeros(x.shape[0], width)], dim=1)
        out.append(torch.nn.functional.silu(buf[:, :width]))
    return torch.cat(out, dim=1)


def _act_diff(x1, xn, y1, yn):
    row = {"idx": 5, "key": KEY, "step": 0, "phase": "forward", "module": "experts.act_fn",
           "kind": "out", "call": 0, "name": "0", "cls": "SiLUActivation", "style": None,
           "bitwise": bits.bitwise_equal(y1, yn), "bound": None}
    return DegreeDiff("4", [row], [], [], {KEY: (y1, yn), IN: (x1, xn)}), row


def _path_change():
    x = torch.randn(64, 96, generator=torch.Generator().manual_seed(0))
    # TP=1: rows of 96 (whole vectors on AVX2 and AVX-512); TP=4: rows of 24 (a scalar tail on both)
    y1, yn = _silu_rows(x, 96), _silu_rows(x, 24)
    if bits.bitwise_equal(y1, yn):
        pytest.skip("this CPU's SiLU kernel gives the same bits for both row widths")
    return x, y1, yn


def test_elementwise_path_change_is_a_shape_dependent_kernel():
    x, y1, yn = _path_change()
    dd, row = _act_diff(x, x.clone(), y1, yn)
    generic_bound.add_generic_bounds(dd, 4)
    assert row["generic_cause"] == "shape-dependent-kernel" and row["beyond_bound"] is False, row
    assert 0 < row["bound_ratio"] <= 1
    assert classify(row) == "shape-dependent-kernel"


def test_a_larger_difference_or_unequal_inputs_are_not_named():
    x, y1, yn = _path_change()
    # negative control 1: the same inputs, an output off by far more than a kernel path (2^-10)
    dd, row = _act_diff(x, x.clone(), y1, yn * (1 + 2.0 ** -10))
    generic_bound.add_generic_bounds(dd, 4)
    assert "generic_cause" not in row and classify(row) == "unknown", row
    assert "more than 8 ULP" in row["cause_why"]
    # negative control 2: inputs that differ in one bit - not judged by this model at all
    xn = x.clone()
    xn.view(torch.int32)[0, 0] ^= 1
    dd, row = _act_diff(x, xn, y1, yn)
    generic_bound.add_generic_bounds(dd, 4)
    assert "generic_cause" not in row and classify(row) == "unknown", row
    assert "no rounding model fits" in row["cause_why"]


def _grad_row(idx, phase, kind, module, name, rank_consistent=False, **extra):
    return {"idx": idx, "key": f"s0/{phase}/{module}/{kind}#0/{name}", "step": 0, "phase": phase,
            "module": module, "kind": kind, "call": 0, "name": name, "cls": "XIELUActivation",
            "style": None, "bitwise": False, "rank_consistent": rank_consistent, "max_abs": 1e-3,
            "max_ulp": 10, "mismatch_fraction": 1.0, "rank_max_abs": 1e-3, **extra}


def test_rank_partial_replica_says_its_copies_sum_to_the_reference():
    g = torch.Generator().manual_seed(1)
    copies = [torch.randn(1, generator=g) * 1e-3 for _ in range(2)]
    ref = copies[0] + copies[1]  # the reference summed every column; each rank only its own
    row = {}
    _partial_sum(row, ref, copies)
    assert row["rank_partial_sum"]["sum_max_abs"] <= 1e-9 < row["rank_partial_sum"]["copy_max_abs"]
    # negative control: copies that differ but do not add up to the reference (one rank stale)
    for bad in ([copies[0], copies[0] * 1.5], [ref, ref * (1 + 2.0 ** -20)]):
        other = {}
        _partial_sum(other, ref, bad)
        assert "rank_partial_sum" not in other, (bad, other)

    rows = [_grad_row(1, "backward", "param_grad", "mlp.act_fn", "alpha_p",
                      rank_partial_sum=row["rank_partial_sum"]),
            _grad_row(2, "optimizer", "param", "mlp.act_fn", "alpha_p"),
            _grad_row(3, "optimizer", "param", "norm", "weight")]
    found = locate(DegreeDiff("2", rows, [], [], {}), {})["findings"]
    assert [f["cause"] for f in found] == ["rank-inconsistent-replica"] * 3
    assert found[0]["partial_sum"] and "add up to the reference" in found[0]["detail"]
    assert [f.get("after") for f in found[1:]] == [rows[0]["key"]] * 2
    # without the partial-sum evidence no finding claims a cause it cannot show
    plain = locate(DegreeDiff("2", [_grad_row(1, "backward", "param_grad", "m", "w"),
                                    _grad_row(2, "optimizer", "param", "m", "w")], [], [], {}), {})
    assert all("detail" not in f and "after" not in f for f in plain["findings"])


def test_a_library_error_names_the_hf_model_line_that_led_to_it():
    # llama4_text at TP=2 fails inside torch autograd (an in-place add on a TP style's output)
    # and inkling_text inside a DTensor Partial reduction with an empty message: the one line
    # must name the model's own line (and, when the message is empty, where it was raised)
    from tpdiag.runner.rank_errors import describe, library_where

    model = "/x/site-packages/transformers/models/fake/modeling_fake.py"
    lib = "/x/site-packages/torch/distributed/tensor/placement_types.py"
    ns: dict = {}
    exec(compile("def _reduce_value():\n    raise AssertionError\n", lib, "exec"), ns)
    exec(compile("def forward(f):\n    f()\n", model, "exec"), ns)
    try:
        ns["forward"](ns["_reduce_value"])
    except AssertionError as e:
        msg, where = library_where(e, "")
    assert msg == "(no message) at torch/distributed/tensor/placement_types.py:2 in _reduce_value"
    assert where == "transformers/models/fake/modeling_fake.py:2 in forward"
    line = describe({"type": "AssertionError", "message": msg, "where": None, "model_where": where})
    assert line.startswith("AssertionError (from transformers/models/fake/modeling_fake.py:2 in forward): "
                           "(no message) at torch/"), line
    # no model frame: the plain form, unchanged
    assert describe({"type": "RuntimeError", "message": "injected fault"}) == "RuntimeError: injected fault"
