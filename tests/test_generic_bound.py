"""The generic (layout-free) bound on synthetic reorderings: every pure reordering of a
row-parallel GEMM - any split, partials rounded to the dtype, any summation order, fp32 and
bf16 - stays inside it; a wrong bias, order or scale is far beyond. No worlds: pure diff code."""
import torch

from tpdiag.diff import bits, generic_bound
from tpdiag.diff.engine import DegreeDiff

KEY = "s0/forward/m/out#0/0"


def degree_diff(x, w, b, y1, yn, ops=()):
    row = {"idx": 9, "key": KEY, "step": 0, "phase": "forward", "module": "m", "kind": "out",
           "call": 0, "name": "0", "cls": "HandWritten", "style": None,
           "bitwise": bits.bitwise_equal(y1, yn), "bound": None}
    tensors = {KEY: (y1, yn), "s0/forward/m/in#0/0": (x, x), "s0/init/m/param_init#0/weight": (w, w)}
    if b is not None:
        tensors["s0/init/m/param_init#0/bias"] = (b, b)
    unc = [{"kind": "op", "step": 0, "phase": "forward", "module": "m", "name": n, "idx": i, "why": why}
           for i, (n, why) in enumerate(ops)]
    return DegreeDiff("2", [row], [], [], tensors, unc), row


def data(dtype, k=512, seed=0, spread=0):
    g = torch.Generator().manual_seed(seed)
    # spread: columns of very different scale, so partial sums cancel (hard for any bound)
    x = torch.randn(32, k, generator=g) * 10.0 ** torch.randint(-spread, spread + 1, (k,), generator=g)
    w = torch.randn(64, k, generator=g) / k ** 0.5
    b = torch.randn(64, generator=g)
    return x.to(dtype), w.to(dtype), b.to(dtype)


def reorderings(x, w, b, n):
    """TP=n row-parallel evaluations of x W^T + b: partials rounded to the dtype, then summed
    in several orders (what an all-reduce may do), bias added once."""
    k = x.shape[1] // n
    parts = [x[:, r * k:(r + 1) * k] @ w[:, r * k:(r + 1) * k].T for r in range(n)]
    seq = parts[0]
    for p in parts[1:]:
        seq = seq + p
    rev = parts[-1]
    for p in parts[-2::-1]:
        rev = rev + p
    tree = list(parts)
    while len(tree) > 1:
        tree = [tree[i] + tree[i + 1] for i in range(0, len(tree), 2)]
    return [seq + b, rev + b, tree[0] + b]


def test_pure_reorderings_never_exceed_the_bound():
    for dtype in (torch.float32, torch.bfloat16):
        for seed in range(3):
            x, w, b = data(dtype, seed=seed, spread=seed)
            y1 = x @ w.T + b
            worst = 0.0
            for n in (2, 4, 8):
                for yn in reorderings(x, w, b, n):
                    dd, row = degree_diff(x, w, b, y1, yn)
                    generic_bound.add_generic_bounds(dd, n + 1)
                    if row["bitwise"]:
                        continue
                    assert row["beyond_bound"] is False, (dtype, n, row)
                    assert "bias" in row["bound_model"]
                    worst = max(worst, row["bound_ratio"])
            assert 0 < worst < 1, (dtype, worst)


def test_wrong_bias_order_and_scale_are_far_beyond():
    for dtype in (torch.float32, torch.bfloat16):
        x, w, b = data(dtype)
        y1 = x @ w.T + b
        n = 2
        ok = reorderings(x, w, b, n)[0]
        wrong = {"bias on every rank": ok + b,
                 "shards gathered in reverse": torch.cat(ok.chunk(n, dim=-1)[::-1], dim=-1),
                 "local scale": ok * n ** 0.5}
        for what, yn in wrong.items():
            dd, row = degree_diff(x, w, b, y1, yn)
            generic_bound.add_generic_bounds(dd, n + 1)
            # bf16: partials rounded to bf16 cost u_bf16 * sum|x_k w_k| each, ~sqrt(K) x |y|,
            # so a bias of the size of y is only a few bounds beyond; fp32 is far beyond
            assert row["beyond_bound"] is True, (dtype, what, row)
            assert row["bound_ratio"] > (100 if dtype == torch.float32 else 2), (dtype, what, row)


def test_no_model_fits_a_nonlinear_module_and_says_why():
    x, w, b = data(torch.float32)
    y1 = torch.tanh(x @ w.T + b)
    yn = torch.nextafter(y1, torch.full_like(y1, 2.0))  # one ULP: a reordering's size
    dd, row = degree_diff(x, w, b, y1, yn)
    generic_bound.add_generic_bounds(dd, 3)
    assert row.get("bound") is None and "generic_cause" not in row
    assert "no rounding model fits" in generic_bound.why_unknown(row)


def test_reordering_is_named_by_the_modules_ops():
    x, w, b = data(torch.float32)
    y1 = x @ w.T + b
    yn = reorderings(x, w, b, 4)[0]
    cases = [((), "unknown"),
             ((("c10d::allreduce_#0.0", "collective output before wait_tensor"),), "row-parallel-reduction"),
             ((("_c10d_functional::reduce_scatter_tensor#0.0", "only at this degree"),), "row-parallel-reduction"),
             ((("aten::mm#0.0", "no reference op of the same shape"),
               ("c10d::allgather_#0.0", "collective output before wait_tensor")), "shape-dependent-gemm")]
    for ops, cause in cases:
        dd, row = degree_diff(x, w, b, y1, yn, ops)
        generic_bound.add_generic_bounds(dd, 5)
        assert row["beyond_bound"] is False and row["generic_cause"] == cause, (ops, row)
        if cause == "unknown":
            assert "its ops were not recorded" in row["cause_why"]


def test_weights_named_cause_says_how_it_was_judged():
    # a module with no ops recorded, named by its row-parallel weight (diff/generic_bound._weights_cause):
    # judged inside its length-k bound, its why must say so - on e403778..9bf6702 it always read
    # "near its float64 re-execution", a float64 run that never happened on this path
    from types import SimpleNamespace

    rows = [{"kind": "param_init", "module": "mlp.down", "layout": "shard:1", "shape": [4, 8]},
            {"kind": "out", "module": "mlp", "step": 0, "phase": "forward"}]
    dd = SimpleNamespace(rows=rows, uncompared=[])
    cause, why = generic_bound.reorder_cause(dd, rows[1], 8)
    assert cause == "row-parallel-reduction"
    assert "within the rounding bound of its length-8 reduction" in why and "float64" not in why, why
    cause, why = generic_bound.reorder_cause(dd, rows[1], None)
    assert cause == "row-parallel-reduction" and "near its float64 re-execution" in why, why
    # control: no sharded matrix, no name
    dd.rows = rows[1:]
    assert generic_bound.reorder_cause(dd, rows[1], 8)[0] == "unknown"
