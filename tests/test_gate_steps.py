"""A correct bf16 run of several steps passes `tpdiag gate --allow rounding`. The gate's moved-record
check (diff/not_judged.cut: no record from the first divergence on may move beyond what rounding moves
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
