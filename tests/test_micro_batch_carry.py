"""`compare --micro-batch 4,1 --fix all`: bitwise weight grads, grad norm and updated parameters
across micro-batch sizes (grad accumulation's fp32 carry, kernels/grad_carry.py), real worlds,
tiny shapes. Negative control: the same run without --fix diverges at a weight grad, so the
record checks below can fail.
"""
import csv

import pytest
from conftest import run_cli, summary_of

TINY = ("--batch-size", "4", "--seq-len", "8")
STEP = ("param_grad", "grad_norm", "param")  # what accumulation feeds: grads, their norm, the update


def _rows(out, label):
    return [r for r in csv.DictReader(open(out / "diff.csv")) if r["degree"] == label]


def _compare(out, *args):
    r = run_cli("compare", *args, *TINY, "--no-confirm", "--no-baseline", "--out", str(out), "--format", "json")
    assert r.returncode == 0, r.stderr
    return summary_of(out)


def _run(request, tmp_path, dtype, name, *args):
    """float32: conftest's session run of these args (test_micro_batch reads it too); else a
    compare of its own."""
    if dtype == "float32":
        out = request.getfixturevalue(f"mb41_{name}_run")
    else:
        out = tmp_path / name
        _compare(out, "--tp", "1", "--micro-batch", "4,1", "--dtype", dtype, *args)
    return out, summary_of(out)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fix_all_weight_grads_bitwise_across_micro_batches(request, tmp_path, dtype):
    fixed_dir, fixed = _run(request, tmp_path, dtype, "fixall", "--fix", "all")
    e = fixed["configurations"]["1-mb1"]
    assert fixed["status"] == "bitwise" and e["status"] == "bitwise", e.get("first_divergence")
    rows = _rows(fixed_dir, "1-mb1")
    step = [r for r in rows if r["kind"] in STEP]
    # every parameter's grad and updated value was compared (21 in tiny-llama), and the norm
    assert sum(r["kind"] == "param_grad" for r in step) == 21
    assert sum(r["kind"] == "param" for r in step) == 21
    assert sum(r["kind"] == "grad_norm" for r in step) == 1
    assert all(r["bitwise"] == "True" for r in rows), [r["key"] for r in rows if r["bitwise"] != "True"]
    # negative control: stock, the same records - gradient accumulation's other summation order
    stock_dir, stock = _run(request, tmp_path, dtype, "stock")
    s = stock["configurations"]["1-mb1"]
    assert s["status"] == "divergent"
    bad = [r for r in _rows(stock_dir, "1-mb1") if r["kind"] == "param_grad" and r["bitwise"] != "True"]
    assert any(r["name"] == "weight" for r in bad), s["first_divergence"]


def test_fix_all_tp_and_micro_batch_grid_bitwise(tmp_path):
    s = _compare(tmp_path / "grid", "--tp", "1,2", "--micro-batch", "4,1", "--grid", "--fix", "all")
    assert set(s["degrees"]) == {"2"} and set(s["configurations"]) == {"1-mb1", "2-mb1"}
    entries = {"2": s["degrees"]["2"], **s["configurations"]}
    assert all(e["status"] == "bitwise" for e in entries.values()), {
        k: e.get("first_divergence") for k, e in entries.items()}
    assert s["status"] == "bitwise"
    for label in entries:
        assert sum(r["kind"] == "param_grad" and r["bitwise"] == "True"
                   for r in _rows(tmp_path / "grid", label)) == 21, label


def test_pieces_off_the_block_grid_are_refused(tmp_path):
    """6-token micro-batches (--seq-len 6) cannot continue an 8-token block walk: one line, exit 2."""
    out = tmp_path / "run"
    r = run_cli("compare", "--tp", "1", "--micro-batch", "4,1", "--batch-size", "4", "--seq-len", "6",
                "--fix", "all", "--no-confirm", "--no-baseline", "--out", str(out))
    assert r.returncode == 2, r.stdout + r.stderr
    assert "multiple of 8 tokens" in r.stdout + r.stderr
