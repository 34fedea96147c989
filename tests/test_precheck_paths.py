"""compare's pre-launch refusals on the other paths: the variant matrix (`compare --variants`)
and the in-process `tpdiag.capture`; and `--debug` rank tracebacks from a matrix.

Cheap: the refusals start no world (one CLI start each) and the capture checks run in-process;
only the --debug case runs two small worlds.
"""
import json
import os

import pytest
import torch
from torch import nn

from conftest import ROOT, run_cli

MODEL = os.path.join("tests", "models", "user_style.py")


def _hf_dir(tmp_path, kind: str) -> str:
    d = tmp_path / kind
    d.mkdir()
    cfg = {"model_type": kind, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 4,
           "intermediate_size": 128, "num_hidden_layers": 1, "vocab_size": 128}
    (d / "config.json").write_text(json.dumps(cfg))
    return f"hf:{d}"


@pytest.mark.parametrize("spec,tp,needle", [
    (f"py:{MODEL}:target_bad_plan", "1,2", "plan entry 'blocks.*.fc1' matches no module"),
    (f"py:{MODEL}:target", "1,3", "--tp 3: does not divide embed vocab=128"),
    ("hf:stablelm", "1,2", "stablelm has no tensor-parallel plan"),
    # a plan of the embedding alone is a plan: it was called "no base_model_tp_plan" before
    ("hf:diffllama", "1,2", "diffllama's tensor-parallel plan in transformers splits only embed_tokens "
                            "(base_model_tp_plan: no layer is split"),
])
def test_matrix_refused_before_any_world_starts(tmp_path, spec, tp, needle):
    if spec.startswith("hf:"):
        pytest.importorskip("transformers", minversion="5")
        spec = _hf_dir(tmp_path, spec[3:])
    out = tmp_path / "run"
    p = run_cli("compare", "--model", spec, "--tp", tp, "--out", str(out), "--variants", "stock,fix:all")
    assert p.returncode == 2, p.stderr + p.stdout
    assert needle in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert not out.exists()  # nothing launched, nothing written


def test_matrix_debug_prints_each_failed_ranks_traceback(tmp_path):
    out = tmp_path / "run"
    p = run_cli("compare", "--model", f"py:{MODEL}:target_bad_loss", "--tp", "1,2", "--out", str(out),
                "--variants", "stock", "--no-baseline", "--format", "json", "--debug")
    assert p.returncode == 2, p.stderr + p.stdout
    line = next(i for i, x in enumerate(open(os.path.join(ROOT, MODEL)), 1) if "F.cross_entropy" in x)
    assert "--- variant stock TP=2 rank" in p.stderr, p.stderr
    assert f'{MODEL}", line {line}, in bad_loss' in p.stderr, p.stderr


class _Two(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 6)
        self.fc2 = nn.Linear(6, 8)

    def forward(self, x):
        return self.fc2(self.fc1(x))


def test_capture_refuses_a_plan_entry_that_matches_nothing(tmp_path):
    import tpdiag
    from tpdiag.errors import BadInput

    out = tmp_path / "cap"
    with pytest.raises(BadInput, match=r"plan entry 'fc3' matches no module"):
        with tpdiag.capture(_Two(), out=str(out), plan={"fc1": "colwise", "fc3": "rowwise"}):
            pass
    assert not (out / "manifest.json").exists()
    # 'module.param' entries (transformers' packed expert weights) and style names are fine
    with tpdiag.capture(_Two(), out=str(out), plan={"fc1": "colwise", "fc2.weight": "rowwise"}) as cap:
        cap.batch(input_ids=torch.zeros(2, 8))
    assert (out / "manifest.json").exists()


def test_capture_degree_check_reads_whole_shapes_only():
    from torch.distributed.tensor.parallel import ColwiseParallel

    from tpdiag.errors import BadInput
    from tpdiag.models.precheck import check_model_plan

    plan = {"fc1": ColwiseParallel()}
    # an unsharded model: 6 output features do not split 4 ways
    with pytest.raises(BadInput, match=r"^TP group size 4: does not divide fc1 out_features=6 of x; degrees that divide every size split: 1, 2, 3, 6$"):
        check_model_plan(_Two(), plan, [4], "capture(plan=...)", "x", flag="TP group size")
    check_model_plan(_Two(), plan, [2], "capture(plan=...)", "x", flag="TP group size")
    # a plain weight of an already-sharded model holds its LOCAL shape: not read (no false refusal)
    check_model_plan(_Two(), plan, [4], "capture(plan=...)", "x", global_only=True, flag="TP group size")
