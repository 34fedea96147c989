"""transformers' TP plans are written for every layer (`layers.*.mlp.experts`); in a model whose first
layers are dense (deepseek_v3's first_k_dense_replace) torch's parallelize_module warned once per key
and dense layer, with the layer's module repr, on every rank - dozens of lines of noise on stderr
for a correct run. tpdiag checks itself that every key matches some module (a key matching none is
refused in one line), so that warning is left out."""
from conftest import run_cli
from hf_configs import write_tiny


def test_no_per_layer_plan_warnings(tmp_path):
    spec = write_tiny("deepseek_v3", tmp_path / "m")
    p = run_cli("compare", "--model", spec, "--tp", "1,2", "--forward-only", "--batch-size", "1", "--seq-len", "8",
                "--no-baseline", "--no-confirm", "--out", str(tmp_path / "r"))
    assert p.returncode == 0, p.stderr[-3000:]
    assert "could not be resolved" not in p.stderr, p.stderr[:3000]
    assert p.stdout.startswith("verdict: divergent"), p.stdout[:500]


def test_a_key_matching_nothing_is_still_refused():
    import pytest
    import torch

    from tpdiag.errors import BadInput
    from tpdiag.runner.build import _check_plan

    with pytest.raises(BadInput, match="matches no module"):
        _check_plan(torch.nn.Sequential(torch.nn.Linear(2, 2)), {"nothing.*": None})
