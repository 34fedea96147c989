"""`--model py:FILE.py:FUNC`: the documented example target (own plan, inputs and loss) at TP=1,2."""
import importlib.util
import json
import os

import pytest
import torch

from conftest import ROOT, run_cli

EXAMPLE = os.path.join(ROOT, "examples", "py_target.py")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("py") / "run"
    p = run_cli("compare", "--model", f"py:{EXAMPLE}:target", "--tp", "1,2", "--out", str(out),
                "--no-confirm", "--format", "json")
    assert p.returncode == 0, p.stderr + p.stdout
    return out, json.loads(p.stdout)


def test_first_divergence_is_row_parallel_fc2(run):
    _, s = run
    d = s["degrees"]["2"]
    fd = d["first_divergence"]
    assert fd["phase"] == "forward" and fd["module"] == "blocks.0.fc2", fd
    assert fd["cause"] == "row-parallel-reduction" and 0 < fd["max_abs"] <= fd["bound"]
    assert d["findings"] == [] and d["unmatched"] == [] and d["missing"] == []


def test_custom_inputs_and_loss_are_used(run):
    from safetensors import safe_open

    out, s = run
    spec = importlib.util.spec_from_file_location("tpdiag_example_py_target", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    events = [json.loads(x) for x in open(out / "tp1" / "events.jsonl")]
    lab = next(e for e in events if e["kind"] == "batch" and e["name"] == "labels")
    with safe_open(str(out / "tp1" / "records.safetensors"), framework="pt") as f:
        labels = f.get_tensor(str(lab["idx"]))
    assert (labels[:, :mod.PROMPT] == -100).all() and (labels[:, mod.PROMPT:-1] >= 0).all()
    # The recorded loss is the target's own loss of its own batch (seed 1234, batch seed 1235).
    torch.manual_seed(1234)
    t = mod.target()
    batch = t.inputs(torch.Generator().manual_seed(1235))
    with torch.no_grad():
        want = float(t.loss(t.model(batch["input_ids"]), batch["labels"]))
    got = s["degrees"]["2"]["loss"]["reference"]
    assert abs(got - want) < 1e-5, (got, want)
