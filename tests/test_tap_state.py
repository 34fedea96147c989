"""probes/float64_taps.py: a child's output made from constants is tapped through a float64 copy,
never the tensor itself. planted tap_buffer.py:table_scale returns its own float32 buffer (a fixed
scale table) to the model's plain code: the tap made the user's buffer require grad (for good: its
.grad filled at every later step) and, a float32 leaf in the float64 graph, made autograd refuse
the root's float64 backward ("expected dtype Float but got double") - the block's output grad read
"not judged" (summary.json not_judged), the root's re-execution lost."""
import json

import torch

from tests.conftest import run_cli
from tests.models.planted.tap_buffer import TableLM
from tpdiag.probes.float64 import module_oracle_grads


def test_a_returned_buffer_is_tapped_by_a_copy():
    torch.manual_seed(0)
    m = TableLM()
    tokens = torch.randint(0, 32, (2, 8))
    out = m(tokens)
    grads, notes = module_oracle_grads(m, (tokens,), {}, torch.ones_like(out),
                                       taps={m.scale: "scale", m.block: "block"})
    assert notes == {} and grads is not None, notes
    assert {"tap:scale:0:0", "tap:block:0:0"} <= set(grads)
    assert grads["tap:scale:0:0"].dtype == torch.float64 and grads["tap:scale:0:0"].shape == m.scale.table.shape
    assert not m.scale.table.requires_grad and m.scale.table.dtype == torch.float32  # the user's state as it was


def test_a_model_returning_its_buffer_is_judged(tmp_path):
    d = tmp_path / "r"
    p = run_cli("compare", "--model", "py:tests/models/planted/tap_buffer.py:table_scale", "--tp", "1,2",
                "--steps", "2", "--no-baseline", "--no-confirm", "--out", str(d), env={"OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    e = json.loads((d / "summary.json").read_text())["degrees"]["2"]
    assert e["class"] == "rounding" and not e.get("not_judged"), (e.get("not_judged"), p.stdout[-2000:])
