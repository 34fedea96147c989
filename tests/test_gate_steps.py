"""A correct bf16 run of several steps passes `tpdiag gate --allow rounding`. The gate's moved-record
check (diff/moved_records.cut: no record from the first divergence on may move beyond what rounding moves
an unjudged grad and be no finding) read every step, and steps after the first start from weights the
updates already moved apart: built-in tiny-llama bf16 --tp 1,2 --steps 3, correct, moved its grads
~0.01 of their norm at step 0 and 0.21-0.24 at step 2 in the confirmation rerun - past the limit
(0.2), a false "edited after the run" (exit 2). Only the first divergence's step is read now."""
from conftest import run_cli


def test_a_correct_bf16_run_of_three_steps_passes_the_gate_with_rounding_allowed(tmp_path):
    d = tmp_path / "r"
    p = run_cli("compare", "--model", "tiny-llama", "--dtype", "bfloat16", "--tp", "1,2", "--steps", "3",
                "--no-baseline", "--out", str(d), env={"OMP_NUM_THREADS": "1"})
    assert p.returncode == 0 and "rounding only" in p.stdout, p.stdout[-2000:] + p.stderr[-2000:]
    g = run_cli("gate", str(d), "--allow", "rounding")
    assert g.returncode == 0, g.stdout[-2000:] + g.stderr[-2000:]


def test_not_judged_rel_l2_measures_the_first_differing_step_only():
    """llama-1b bf16 --tp 1,2 --steps 3 on 2x H200 (correct, stock) read "not judged (cause unknown)",
    gate 1: its unjudged grads moved 0.047 of their norm at step 0 and 2.9 by step 2 - Adam's first
    update is about lr * sign(grad), so a grad element near zero rounded to the other sign moves its
    weight 2 lr away, and the later steps' grads are another model's. rel_l2 (what the not-judged
    limit reads, and what the gate re-derives) now measures the first differing step's grads; the later
    ones stay listed."""
    from types import SimpleNamespace

    import torch

    from tpdiag.diff.moved_limit import moved_beyond
    from tpdiag.diff.not_judged import grads
    from tpdiag.diff.recheck import moved_problem

    g = torch.Generator().manual_seed(0)
    a0, a2 = torch.randn(64, generator=g), torch.randn(64, generator=g)
    rows = [{"idx": 0, "key": "s0/forward/w/out#0/0", "step": 0, "phase": "forward", "kind": "out", "bitwise": False},
            {"idx": 1, "key": "s0/backward/blk/grad_out#0/0", "step": 0, "phase": "backward", "kind": "grad_out",
             "bitwise": False, "oracle_refused": "dropout"},
            {"idx": 2, "key": "s2/backward/blk/grad_out#0/0", "step": 2, "phase": "backward", "kind": "grad_out",
             "bitwise": False, "oracle_refused": "dropout"}]
    tensors = {rows[1]["key"]: (a0, a0 * (1 + 1e-3)), rows[2]["key"]: (a2, a2 * 3.9)}
    dd = SimpleNamespace(rows=rows, tensors=tensors, oracle_own={"x": 1})
    nj = grads(dd, rows[0]["key"])
    assert nj["records"] == 2 and abs(nj["rel_l2"] - 1e-3) < 1e-6, nj
    assert moved_beyond({"not_judged": {**nj, "dtype": "bfloat16"}, "first_divergence": {}}) is None
    assert moved_problem("2", nj, dd) is None
    # the gate still re-derives it: rel_l2 edited below the first step's move is caught
    assert "edited after the run" in moved_problem("2", {**nj, "rel_l2": 1e-9}, dd)
