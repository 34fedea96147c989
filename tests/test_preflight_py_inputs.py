"""The memory preflight counts a py: Target's own batch (Target.inputs), not --batch-size x --seq-len.

A Target whose `inputs` draw the batch trains on that batch (runner/batch.make_batch): the flags'
batch never runs. The preflight (models/preflight.py) counted --batch-size x --seq-len tokens anyway,
so a user's model over a 50k vocabulary (tests/user_own_batch.py: 2 x 16 tokens of its own) was
refused at --batch-size 64 --seq-len 4096 for the float32 cross-entropy over 262144 x 50000 logits
(~195 GiB) it would never allocate - and let through a Target whose own batch did not fit, had the
flags been small. Now its inputs' rows x positions are counted (the smallest --micro-batch's rows at
most); a Target without inputs is counted at the flags' batch as before (the negative control)."""
import os

import pytest

from conftest import ROOT, run_cli

GiB = 1 << 30
FILE = os.path.join(ROOT, "tests", "user_own_batch.py")
ARGS = ("float32", True, "cpu")


def _spec(func):
    from tpdiag.models.spec import parse_spec

    return parse_spec(f"py:{FILE}:{func}")


def test_a_targets_own_inputs_are_what_the_preflight_counts():
    from tpdiag.errors import BadInput
    from tpdiag.models.capacity import estimate_bytes, model_dims
    from tpdiag.models.preflight import preflight

    dims = model_dims(_spec("target"))
    assert dims["inputs_shape"] == (2, 16), dims
    have = (4 * GiB, "available host memory")
    got = preflight(_spec("target"), (1, 2), 64, 4096, *ARGS, have=have)
    assert got["degrees"]["1"]["fits"] and got["degrees"]["1"]["need_bytes"] == estimate_bytes(dims, 2, 16, *ARGS[:2])
    # the smallest --micro-batch's rows at most: one sequence a call
    one = preflight(_spec("target"), (1,), 64, 4096, *ARGS, have=have, micro_batch=1)
    assert one["degrees"]["1"]["need_bytes"] == estimate_bytes(dims, 1, 16, *ARGS[:2]) < got["degrees"]["1"]["need_bytes"]
    # a batch of its own too large is refused at its own size, the hint naming what to shrink
    with pytest.raises(BadInput) as e:
        preflight(_spec("target"), (1,), 1, 2, *ARGS, have=(estimate_bytes(dims, 2, 16, *ARGS[:2]) - 1, "x"))
    assert "at 2 x 16" in str(e.value) and "Target.inputs' batch" in str(e.value), str(e.value)


def test_without_inputs_the_flags_batch_is_counted_as_before():
    from tpdiag.errors import BadInput
    from tpdiag.models.capacity import estimate_bytes, model_dims
    from tpdiag.models.preflight import preflight

    dims = model_dims(_spec("target_random"))
    assert "inputs_shape" not in dims, dims
    with pytest.raises(BadInput) as e:
        preflight(_spec("target_random"), (1, 2), 64, 4096, *ARGS, have=(4 * GiB, "available host memory"))
    assert str(e.value).startswith("--tp 1: the reference world needs at least") and "at 64 x 4096" in str(e.value)
    assert "lower --batch-size or --seq-len" in str(e.value), str(e.value)
    assert estimate_bytes(dims, 64, 4096, *ARGS[:2]) > 100 * GiB


def test_compare_runs_a_target_whose_flags_batch_would_not_fit(tmp_path):
    # the flags' 64 x 4096 over the 50k vocabulary: ~98 GiB of logits and their float32 cross-entropy
    # even forward only - refused (exit 2) before any world started; the target's own 2 x 16 batch runs
    out = tmp_path / "run"
    p = run_cli("compare", "--model", f"py:{FILE}:target", "--tp", "1,2", "--batch-size", "64", "--seq-len", "4096",
                "--forward-only", "--no-confirm", "--out", str(out))
    assert p.returncode in (0, 1), p.stdout[-2000:] + p.stderr[-2000:]
    assert (out / "summary.json").is_file()
