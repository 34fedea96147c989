"""diff/flat_rows.py: an op's rows that flatten a sequence-sharded activation's [B, S/N] are put
back as that activation is (joined on the sequence dim), not stacked along the flattened dim; a
batch of one, an op with no such module record, or a record with a placement keeps the shape rule."""
import torch

from tpdiag.diff import flat_rows
from tpdiag.records.layout import assemble


class _Side:
    def __init__(self, metas):
        self.by_key = {m["key"]: m for m in metas}


def _metas(b, s, d, n, *, act_world=None):
    op = {"key": "s0/forward/wq/op#0/aten::mm#0.0", "step": 0, "phase": "forward", "module": "wq", "call": 0,
          "kind": "op", "stored": "stacked", "world": n, "local_shape": [b * s // n, d], "placement": None}
    act = {"key": "s0/forward/wq/in#0/0", "step": 0, "phase": "forward", "module": "wq", "call": 0,
           "kind": "in", "stored": "stacked", "world": act_world or n, "local_shape": [b, s // n, d], "placement": None}
    rop = {**op, "stored": "single", "world": 1, "local_shape": [b * s, d]}
    ract = {**act, "stored": "single", "world": 1, "local_shape": [b, s, d]}
    return op, act, rop, ract


def test_flattened_sequence_shard_rows_are_joined_on_the_sequence_dim():
    b, s, d, n = 2, 8, 4, 2
    op, act, rop, ract = _metas(b, s, d, n)
    x = torch.arange(b * s * d, dtype=torch.float32).reshape(b, s, d)
    ref = x.reshape(b * s, d)  # the TP=1 GEMM's rows
    ranks = torch.stack([x[:, r * s // n:(r + 1) * s // n].reshape(-1, d) for r in range(n)])
    shape = flat_rows.rows_of(op, rop, _Side([op, act]), _Side([rop, ract]))
    assert shape == ([b, s // n, d], [b * s, d], 1)
    assert torch.equal(flat_rows.assemble_rows(ranks, shape).full, ref)
    # the shape rule alone (what the diff did before): the ranks' row blocks stacked, another tensor
    assert not torch.equal(assemble(op, ranks, [b * s, d]).full, ref)


def test_the_shape_rule_stands_where_nothing_says_the_rows_are_flattened():
    b, s, d, n = 2, 8, 4, 2
    op, act, rop, ract = _metas(b, s, d, n)
    assert flat_rows.rows_of(op, rop, _Side([op]), _Side([rop])) is None  # no module activation
    assert flat_rows.rows_of({**op, "placement": "shard:0"}, rop, _Side([op, act]), _Side([rop, ract])) is None
    one = _metas(1, s, d, n)  # a batch of one: stacking along dim 0 is already the sequence order
    assert flat_rows.rows_of(one[0], one[2], _Side(one[:2]), _Side(one[2:])) is None
    # an activation not cut on a later dim (replicated at this degree): not a flattening of it
    rep = {**act, "local_shape": [b, s, d]}
    assert flat_rows.rows_of(op, rop, _Side([op, rep]), _Side([rop, ract])) is None


def test_position_major_rows_keep_the_ranks_blocks_stacked():
    """Sequence-first code flattens [B, S/N, D] position-major (`x.transpose(0, 1).reshape(-1, D)`):
    the ranks' blocks stacked are TP=1's rows, and the put-back (batch-major) is another tensor. The
    nearer candidate is read; batch-major rows still read put back."""
    b, s, d, n = 2, 8, 4, 2
    op, act, rop, ract = _metas(b, s, d, n)
    x = torch.arange(b * s * d, dtype=torch.float32).reshape(b, s, d)
    shape = flat_rows.rows_of(op, rop, _Side([op, act]), _Side([rop, ract]))
    for ref, ranks in [
        (x.transpose(0, 1).reshape(-1, d),  # position-major
         torch.stack([x[:, r * s // n:(r + 1) * s // n].transpose(0, 1).reshape(-1, d) for r in range(n)])),
        (x.reshape(-1, d),  # batch-major
         torch.stack([x[:, r * s // n:(r + 1) * s // n].reshape(-1, d) for r in range(n)])),
    ]:
        ra, oa = flat_rows.nearer(lambda: (assemble(rop, ref, [b * s, d]), assemble(op, ranks, [b * s, d])),
                                  (assemble(rop, ref, [b * s, d]), flat_rows.assemble_rows(ranks, shape)))
        assert torch.equal(oa.full, ref) and torch.equal(ra.full, ref)


def test_a_correct_position_major_projection_reads_rounding(tmp_path):
    """planted seq_major.py: a correct context-parallel projection whose GEMM rows are position-major,
    its module's output moved by an all-reduced sum (rounding). Its GEMM's rows put back batch-major
    read `sharding-bug` 1.3e6x beyond rounding at `aten::mm` (class bug) before the fix."""
    import json

    from tests.conftest import run_cli

    d = tmp_path / "run"
    p = run_cli("compare", "--model", "py:tests/models/planted/seq_major.py:seq_major", "--tp", "1,2",
                "--no-baseline", "--no-confirm", "--out", str(d), env={"OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    s = json.loads((d / "summary.json").read_text())
    assert s["class"] == "rounding", p.stdout[-2000:]
    rows = (d / "ops" / "diff.csv").read_text().splitlines()
    mm = [r for r in rows if "s0/forward/proj/op#0/aten::mm#0.0" in r]
    assert mm and ",True," in mm[0], mm
