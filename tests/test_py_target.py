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


def test_py_file_imports_a_module_beside_it(tmp_path):
    # The example's model moves into a module beside the file the spec names, as a user splits
    # a project; neither the CLI nor the rank processes get PYTHONPATH for it (cwd is the repo; the
    # session's own environment, through the tests' CLI server: PYTHONPATH=ROOT set here, where the
    # session has none, as on CI, was a start-up variable of its own - a fresh interpreter).
    import shutil

    shutil.copy(EXAMPLE, tmp_path / "beside_parts_41.py")
    (tmp_path / "entry.py").write_text("from beside_parts_41 import target\n")
    out = tmp_path / "run"
    p = run_cli("compare", "--model", f"py:{tmp_path / 'entry.py'}:target", "--tp", "1,2", "--out", str(out),
                "--forward-only", "--no-confirm", "--no-baseline", "--no-judge-downstream", "--format", "json")
    # (the import and the first divergence, nothing past it)
    assert p.returncode == 0, p.stderr + p.stdout
    fd = json.loads(p.stdout)["degrees"]["2"]["first_divergence"]
    assert fd["module"] == "blocks.0.fc2" and fd["cause"] == "row-parallel-reduction", fd


def test_py_import_failure_names_the_module_and_what_to_do(tmp_path):
    (tmp_path / "errs.py").write_text("import buggy_ln_41_missing\n\ndef just_model():\n    pass\n")
    p = run_cli("compare", "--model", f"py:{tmp_path / 'errs.py'}:just_model", "--tp", "1,2",
                "--out", str(tmp_path / "run"), timeout=120)  # the session's environment, as above
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2 and len(lines) == 1, p.stderr + p.stdout
    msg = lines[0]
    for part in ("no module named 'buggy_ln_41_missing'", "imported by errs.py", str(tmp_path),
                 "beside errs.py", "PYTHONPATH"):
        assert part in msg, msg
    # a dotted module spec that is not importable says how to make it so (the same function, in-process)
    from tpdiag.errors import BadInput
    from tpdiag.models.spec import parse_spec, py_target

    with pytest.raises(BadInput) as e:
        py_target(parse_spec("py:no_such_pkg_41.models:target").value)
    assert "no module named 'no_such_pkg_41'" in str(e.value) and "PYTHONPATH" in str(e.value)
    assert "py:FILE.py:FUNC" in str(e.value), str(e.value)


def test_py_target_that_calls_from_pretrained_draws_no_progress_bar(tmp_path, monkeypatch, capfd):
    """An RL team's FUNC loads its checkpoint with from_pretrained, as the documented one does
    (docs/models-py.md): it runs in every rank of every world, and each call drew transformers'
    'Loading weights' bar into the compare's output (14 bars in a --tp 1,2 --micro-batch 2,1 run) -
    output to a file or pipe is plain text without progress (README). Called here as a rank calls it,
    in a process whose transformers has its bar on (a fresh interpreter's default)."""
    transformers = pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM, LlamaConfig

    from tpdiag.models.spec import parse_spec, py_target

    cfg = LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=2, vocab_size=32)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "ck")
    (tmp_path / "trainer.py").write_text(
        "import torch\nimport tpdiag\nfrom transformers import AutoModelForCausalLM\n\n\n"
        "def target():\n"
        f"    model = AutoModelForCausalLM.from_pretrained({str(tmp_path / 'ck')!r}, dtype=torch.float32)\n"
        "    return tpdiag.Target(model=model, plan={}, vocab_size=32)\n")
    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    transformers.utils.logging.enable_progress_bar()
    capfd.readouterr()
    t = py_target(parse_spec(f"py:{tmp_path / 'trainer.py'}:target").value)
    assert t.model.config.vocab_size == 32
    err = capfd.readouterr().err
    assert "Loading weights" not in err, err
