"""`tpdiag.capture` under torchrun (gloo, 1 and 2 processes), then `tpdiag diff` of the two."""
import csv
import json
import os
import shutil

import pytest
import torch

from conftest import ROOT, run_cli, run_module

EXAMPLE = os.path.join(ROOT, "examples", "capture_torchrun.py")
ROW_PARALLEL = ("layers.0.attention.wo", "layers.0.feed_forward.w2")


def torchrun(nproc: int, out, *args) -> None:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = run_module("torch.distributed.run", "--standalone",
                   "--nproc-per-node", str(nproc), EXAMPLE, "--out", str(out), *args, env=env, cwd=ROOT, timeout=300)
    if p.returncode != 0:
        # torch 2.13 + gloo: a rank can abort at interpreter teardown ("terminate called without
        # an active exception", SIGABRT) after its work is done. The evidence decides: the
        # capture must be complete (its manifest is written last, atomically); a rank that died
        # before that is a real failure and fails here.
        manifest = out / "manifest.json"
        assert "terminate called without an active exception" in p.stderr and manifest.is_file() \
            and json.loads(manifest.read_text()).get("complete") is True, p.stdout[-3000:] + p.stderr[-3000:]


@pytest.fixture(scope="module")
def captures(tmp_path_factory):
    base = tmp_path_factory.mktemp("capture")
    torchrun(1, base / "tp1")
    torchrun(2, base / "tp2")
    return base


def test_capture_directory_matches_compare_layout(captures):
    for n in (1, 2):
        d = captures / f"tp{n}"
        for f in ("events.jsonl", "records.safetensors", "world.json", "manifest.json"):
            assert (d / f).is_file(), (d, f)
        m = json.loads((d / "manifest.json").read_text())
        assert m["tool"] == "tpdiag.capture" and m["complete"] and m["degree"] == n
        assert m["seed"] == 1234 and m["dtype"] == "float32" and m["backend"] == "gloo"
        fp = m["model"]["fingerprint"]["params"]
        assert fp["layers.0.attention.wq.weight"]["shape"] == [256, 256]  # global, not the shard
        assert json.loads((d / "world.json").read_text())["degree"] == n


def test_diff_names_the_first_divergence(captures, tmp_path):
    out = tmp_path / "d"
    p = run_cli("diff", str(captures / "tp1"), str(captures / "tp2"), "--out", str(out),
                "--format", "json")
    assert p.returncode == 0, p.stderr + p.stdout
    s = json.loads(p.stdout)
    # the printed JSON is summary.json plus where it is and the text's "what to do:" line
    assert s.pop("what_to_do").startswith("nothing is wrong")
    assert s == {**json.loads((out / "summary.json").read_text()), "run_dir": str(out)}
    assert s["schema"] == 1 and s["status"] == "divergent" and s["reference"] == 1
    d = s["degrees"]["2"]
    fd = d["first_divergence"]
    assert fd["phase"] == "forward" and fd["module"] in ROW_PARALLEL, fd
    assert fd["cause"] == "row-parallel-reduction" and 0 < fd["max_abs"] <= fd["bound"]
    assert d["findings"] == [] and d["unmatched"] == [] and d["missing"] == []
    assert d["logprobs"]["bitwise"] is False and d["loss"]["reference"] is not None
    with open(out / "diff.csv") as f:
        rows = {r["key"]: r for r in csv.DictReader(f)}
    assert all(r["bitwise"] == "True" for r in rows.values() if r["phase"] == "init")
    for proj in ("wq", "wk", "wv"):
        r = rows[f"s0/forward/layers.0.attention.{proj}/out#0/0"]
        assert r["bitwise"] == "True" and r["layout"] == "shard:2"  # from the layouts table
    assert json.loads((out / "manifest.json").read_text())["tool"] == "tpdiag diff"


def test_diff_and_report_advise_what_a_capture_user_can_run(captures, tmp_path):
    """A capture's model is the user's own loop: the advice is tpdiag.invariant, never a
    `tpdiag compare --fix` that cannot run it; the report header names device and backend."""
    out = tmp_path / "d"
    p = run_cli("diff", str(captures / "tp1"), str(captures / "tp2"), "--out", str(out))
    assert p.returncode == 0, p.stderr + p.stdout
    assert "tpdiag.invariant(model, plan" in p.stdout and "--fix" not in p.stdout, p.stdout
    assert json.loads((out / "summary.json").read_text())["source"] == "capture"
    p = run_cli("report", str(out), "-o", str(tmp_path / "r.html"))
    assert p.returncode == 0, p.stderr
    html = (tmp_path / "r.html").read_text()
    assert "cpu / gloo" in html and "? / ?" not in html
    assert "tpdiag.invariant(model, plan" in html and "--fix" not in html


def test_capture_against_itself_is_bitwise_default_out(captures):
    p = run_cli("diff", str(captures / "tp2"), str(captures / "tp2"), "--format", "json")
    assert p.returncode == 0, p.stderr
    s = json.loads(p.stdout)
    assert s["status"] == "bitwise" and s["degrees"]["2-2"]["first_divergence"] is None
    assert os.path.dirname(s["run_dir"]) == str(captures)
    assert os.path.basename(s["run_dir"]).startswith("diff-")


def test_mismatched_seed_is_refused_in_one_line(captures, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(captures / "tp2", other)
    m = json.loads((other / "manifest.json").read_text())
    m["seed"] = 99
    (other / "manifest.json").write_text(json.dumps(m))
    p = run_cli("diff", str(captures / "tp1"), str(other), "--out", str(tmp_path / "d"))
    lines = [x for x in p.stderr.strip().splitlines() if x.strip()]
    assert p.returncode == 2 and len(lines) == 1, p.stderr + p.stdout
    assert "captures not comparable: seed: 1234" in lines[0] and "99" in lines[0], lines[0]
    assert not (tmp_path / "d").exists()  # refused before anything was written


@pytest.mark.parametrize("edit,needle", [
    (lambda fp: fp["output.weight"].update(shape=[500, 256]), "shape of output.weight"),
    (lambda fp: fp["norm.weight"].update(dtype="bfloat16"), "dtype of norm.weight"),
    (lambda fp: fp.pop("norm.weight"), "parameter: 'norm.weight'"),
])
def test_mismatched_fingerprint_names_the_first_mismatch(captures, edit, needle):
    from tpdiag.diff.runs import check_comparable, read_capture
    from tpdiag.errors import NotComparable

    a, b = read_capture(str(captures / "tp1")), read_capture(str(captures / "tp2"))
    check_comparable(a, b)  # the real pair is comparable (shapes equal up to sharding)
    edit(b["model"]["fingerprint"]["params"])
    with pytest.raises(NotComparable, match=needle):
        check_comparable(a, b)


def test_tp_group_of_a_dp_by_tp_mesh(captures, tmp_path):
    """4 ranks as DP=2 x TP=2: the TP group holding rank 0 records (a subgroup, gathered in that
    group); its capture is bitwise the TP=2 capture."""
    torchrun(4, tmp_path / "dp2", "--dp", "2")
    m = json.loads((tmp_path / "dp2" / "manifest.json").read_text())
    assert m["degree"] == 2 and m["world_size"] == 4
    p = run_cli("diff", str(captures / "tp2"), str(tmp_path / "dp2"), "--out", str(tmp_path / "d"),
                "--format", "json", "--fail-on-divergence")
    assert p.returncode == 0, p.stderr + p.stdout
    assert json.loads(p.stdout)["status"] == "bitwise"


def test_incomplete_capture_is_refused(captures, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(captures / "tp2", other)
    (other / "manifest.json").unlink()
    p = run_cli("diff", str(captures / "tp1"), str(other))
    assert p.returncode == 2 and "no manifest.json" in p.stderr


def test_capture_does_not_change_numerics(tmp_path):
    """Single process, no torch.distributed: probed and unprobed steps give the same bits."""
    import tpdiag
    from tpdiag.models import tiny_llama

    def step(cap_dir):
        torch.manual_seed(0)
        model = tiny_llama.build("tiny-llama", n_layers=1)
        ids = torch.randint(0, 512, (2, 8), generator=torch.Generator().manual_seed(1))
        if cap_dir is None:
            logits = model(ids)
            logits.sum().backward()
        else:
            with tpdiag.capture(model, out=cap_dir, seed=0) as cap:
                logits = model(ids)
                cap.loss(logits.sum())
                logits.sum().backward()
        return logits.detach(), model.output.weight.grad

    a = step(None)
    b = step(tmp_path / "c1")
    c = step(tmp_path / "c2")  # tpdiag.capture is still callable after the module was imported
    for x, y in ((a, b), (a, c)):
        assert all(torch.equal(u.view(torch.int32), v.view(torch.int32)) for u, v in zip(x, y))
    assert json.loads((tmp_path / "c2" / "manifest.json").read_text())["degree"] == 1
