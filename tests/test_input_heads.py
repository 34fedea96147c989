"""A degree that divides every split dimension but not the heads is refused before any world
starts (models/precheck.py _head_dims), in one line naming the head count and the degrees that
would work; a plan that leaves the attention whole is not refused for its heads.
In-process checks (no world) and one CLI start."""
import os

import pytest

from conftest import run_cli
from tpdiag.errors import BadInput
from tpdiag.models.precheck import check_plan
from tpdiag.models.spec import parse_spec

MODEL = os.path.join("tests", "models", "planted", "four_heads.py")


@pytest.mark.parametrize("func,tp,needle", [
    ("counted", "1,16", "--tp 16: does not divide attention n_heads=4, attention n_kv_heads=2 of "),
    ("counted", "1,4", "--tp 4: does not divide attention n_kv_heads=2 of "),
    ("head_dim", "1,8", "--tp 8: does not divide attention.wq heads (out_features 64 / head_dim 16)=4, "),
    ("head_dim", "1,4", "--tp 4: does not divide attention.wk heads (out_features 32 / head_dim 16)=2, "),
])
def test_heads_a_degree_does_not_divide_are_refused(func, tp, needle):
    with pytest.raises(BadInput) as e:
        check_plan(parse_spec(f"py:{MODEL}:{func}"), [int(d) for d in tp.split(",")])
    msg = str(e.value)
    assert msg.startswith(needle) and msg.endswith("; degrees that divide every size split: 1, 2"), msg


@pytest.mark.parametrize("func,tp", [("counted", "1,2"), ("head_dim", "1,2"), ("mlp_only", "1,8"),
                                     ("mlp_only", "1,16")])
def test_degrees_that_split_whole_heads_pass(func, tp):
    check_plan(parse_spec(f"py:{MODEL}:{func}"), [int(d) for d in tp.split(",")])


def test_compare_refuses_tp16_of_four_heads_before_any_world(tmp_path):
    out = tmp_path / "run"
    p = run_cli("compare", "--model", f"py:{MODEL}:counted", "--tp", "1,16", "--out", str(out))
    assert p.returncode == 2, p.stderr + p.stdout
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "--tp 16: does not divide attention n_heads=4" in lines[0], p.stderr
    assert "degrees that divide every size split: 1, 2" in lines[0] and "Traceback" not in p.stderr
    assert not out.exists()  # the TP=1 world and its rerun no longer run first


def test_hf_moe_expert_width_a_degree_does_not_divide_is_refused(tmp_path):
    """transformers' moe_tp_experts splits each expert's width: moe_intermediate_size=12 at TP=8 ran
    TP=1, then every TP=8 world failed in the grouped GEMM ('strides should be multiple of 16 bytes')."""
    import json

    from tpdiag.models.spec import check_degrees

    cfg = {"model_type": "qwen3_moe", "hidden_size": 64, "num_attention_heads": 8, "num_key_value_heads": 8,
           "head_dim": 8, "intermediate_size": 128, "moe_intermediate_size": 12, "vocab_size": 128}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    spec = parse_spec(f"hf:{tmp_path}")
    with pytest.raises(BadInput, match=r"^--tp 8: does not divide moe_intermediate_size=12; valid degrees for "
                                       r"this model: 1, 2, 4$"):
        check_degrees(spec, [1, 8])
    check_degrees(spec, [1, 4])


@pytest.mark.parametrize("custom", [False, True])
def test_hf_config_transformers_cannot_use_is_refused_before_any_world(tmp_path, custom):
    """An unknown model_type, or a config asking for its own code, was passed by the parent's plan
    check; TP=1 and its rerun started and every world failed with the same words. The code is never run."""
    pytest.importorskip("transformers", minversion="5")
    import json

    marker = tmp_path / "CODE_RAN"
    cfg = {"model_type": "tpdiag-test-unknown", "vocab_size": 16}
    if custom:
        cfg["auto_map"] = {"AutoConfig": "configuration_custom.CustomConfig"}
        (tmp_path / "configuration_custom.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(BadInput, match=r"^--model hf:.*: config.json not usable by transformers: "):
        check_plan(parse_spec(f"hf:{tmp_path}"), [1, 2])
    assert not marker.exists()


@pytest.mark.parametrize("make,what", [("file", "is not a .py file"), ("dir", "is a directory"),
                                       (None, "does not exist")])
def test_a_py_spec_path_that_is_no_python_file_says_so(tmp_path, make, what):
    """'no module named '/x/model': add the directory that holds /x/model to PYTHONPATH' before."""
    from tpdiag.models.spec import load_target

    path = tmp_path / "model"
    if make == "file":
        path.write_text("x")
    elif make == "dir":
        path.mkdir()
    with pytest.raises(BadInput, match=rf"failed: {path} {what}; expected py:FILE.py:FUNC"):
        load_target(parse_spec(f"py:{path}:target"))
