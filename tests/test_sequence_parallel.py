"""Sequence parallelism (--variant sp): norms sharded on the sequence, norm-weight-grad found,
confirmed by invariant-norm-grad, and every fix on is bitwise."""
import json

from conftest import run_cli


def compare(tmp_path, *args):
    p = run_cli("compare", "--variant", "sp", "--out", str(tmp_path / "r"), "--format", "json",
                "--no-baseline", *args)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def test_sp_fix_all_is_bitwise(tmp_path):
    s = compare(tmp_path, "--tp", "1,2,4", "--fix", "all", "--no-confirm")
    assert s["status"] == "bitwise", json.dumps(s["degrees"])[:1500]
    assert all(d["n_divergent"] == 0 for d in s["degrees"].values())


def test_norm_weight_grad_is_found_and_confirmed(tmp_path):
    rest = "tp-invariant-linear,invariant-gemm,invariant-vocab-softmax,invariant-grad-norm"
    # TP=1,2 (was 1,4): the sequence-sharded norms' weight grads differ there too, and the fix
    # confirms bitwise; every fix at TP=4 is test_sp_fix_all_is_bitwise's
    s = compare(tmp_path, "--tp", "1,2", "--fix", rest)
    d = s["degrees"]["2"]
    fd = d["first_divergence"]
    assert fd["phase"] == "backward" and fd["kind"] == "param_grad" and fd["cause"] == "norm-weight-grad"
    assert fd["module"].endswith("norm")
    conf = d["confirmation"]
    assert conf["fix"] == "invariant-norm-grad" and conf["verdict"] == "confirmed"
    assert conf["status_after"] == "bitwise"
