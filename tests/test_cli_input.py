"""Bad input: one clear line, exit 2, before any world starts."""
import pytest
from conftest import on_cpu
from typer.testing import CliRunner

from tpdiag.cli import app

runner = CliRunner()


@pytest.mark.parametrize("args,needle", [
    (["--tp", "3"], "need at least two degrees"),
    (["--tp", "1,3"], "--tp 3: does not divide"),
    (["--tp", "0,x"], "is not an integer"),
    (["--tp", "1,0"], "must be >= 1"),
    (["--model", "nope"], "unknown model"),
    (["--model", "hf:/does/not/exist"], "no directory '/does/not/exist'"),
    (["--model", "py:missing.py:f"], "not found"),
    (["--dtype", "float13"], "expected one of float32, bfloat16, float16"),
    (["--fix", "magic"], "unknown fix"),
    (["--steps", "0"], "must be >= 1"),
    (["--format", "xml"], "expected one of text, json"),
    (["--tp", "1,4", "--tree-groups", "2"], "--tree-groups 2: TP=4 does not divide 2 tree groups"),
    (["--tp", "1,2", "--tree-groups", "6"], "must be a power of two"),
    (["--tp", "1,2", "--tree-groups", "-2"], "must be a power of two"),
])
def test_bad_input_is_one_line_exit_2(args, needle, tmp_path):
    r = runner.invoke(app, on_cpu(["compare", "--out", str(tmp_path / "r"), *args]))
    assert r.exit_code == 2, r.output
    lines = [line for line in r.output.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], r.output
    assert "Traceback" not in r.output
    assert not (tmp_path / "r").exists()  # nothing started, nothing written


@pytest.mark.parametrize("var,value", [("TPDIAG_HASH_BATCH", "abc"), ("TPDIAG_HASH_BATCH", "0"),
                                       ("TPDIAG_HASH_BATCH", "99999"), ("TPDIAG_HASH_CAP_MB", "-5"),
                                       ("TPDIAG_HASH_CAP_MB", "0"), ("TPDIAG_HASH_CAP_MB", "1G"),
                                       ("TPDIAG_HASH_NARROW_REGS", "16"), ("TPDIAG_HASH_NARROW_REGS", "x"),
                                       ("TPDIAG_HOST_BUDGET", "lots"),
                                       ("TPDIAG_HOST_CHUNK", "-1"), ("TPDIAG_HOST_PINNED", "no"),
                                       # read inside every world: abc and -5 ran with the default cap, x
                                       # failed each rank or was ignored (hhouse23)
                                       ("TPDIAG_ANCHOR_MAX_MB", "abc"), ("TPDIAG_ANCHOR_MAX_MB", "-5"),
                                       ("TPDIAG_OPT_F64_MAX_MB", "x"),
                                       ("TPDIAG_MAX_READ_MB", "x"), ("TPDIAG_MAX_READ_MB", "1.5"),
                                       ("TPDIAG_GATHER_WINDOW", "lots"), ("TPDIAG_TREE_OVERLAP_CHUNKS", "x"),
                                       ("TPDIAG_TREE_OVERLAP_SMS", "-1"), ("TPDIAG_LOCAL_RANKS", "x")])
def test_bad_hash_queue_env_is_one_line_exit_2(var, value, tmp_path, monkeypatch):
    monkeypatch.setenv(var, value)
    r = runner.invoke(app, on_cpu(["compare", "--out", str(tmp_path / "r")]))
    assert r.exit_code == 2, r.output
    lines = [line for line in r.output.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and var in lines[0], r.output
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("value,needle", [("abc", "expected a power-of-two"),
                                          ("2", "TP=4 does not divide 2 tree groups")])
def test_bad_tree_groups_env_is_one_line_exit_2(value, needle, tmp_path, monkeypatch):
    monkeypatch.setenv("TPDIAG_TREE_GROUPS", value)
    r = runner.invoke(app, on_cpu(["compare", "--out", str(tmp_path / "r")]))
    assert r.exit_code == 2, r.output
    lines = [line for line in r.output.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and "TPDIAG_TREE_GROUPS" in lines[0] and needle in lines[0], r.output
    assert not (tmp_path / "r").exists()


def test_a_model_named_without_its_prefix_gets_the_spec_it_meant(tmp_path):
    """A new user's first hf: run: `--model ./ckpt` (the save_pretrained directory) read only
    'unknown model'; the line now gives the spec with its prefix (and a plain name still none)."""
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text("{}")
    (tmp_path / "model.py").write_text("")
    for model, hint in [(str(tmp_path / "ckpt"), f"(a model directory: --model hf:{tmp_path / 'ckpt'})"),
                        (str(tmp_path / "model.py"), f"(a Python file: --model py:{tmp_path / 'model.py'}:FUNC"),
                        ("tiny-lama", None)]:
        r = runner.invoke(app, on_cpu(["compare", "--out", str(tmp_path / "r"), "--model", model]))
        lines = [line for line in r.output.strip().splitlines() if line.strip()]
        assert r.exit_code == 2 and len(lines) == 1 and "unknown model" in lines[0], r.output
        assert (hint in lines[0]) if hint else lines[0].endswith("hf:DIR or py:FILE.py:FUNC"), r.output
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("code,needle", [
    # each world failed with FUNC's TypeError (verdict inconclusive, a table of failures)
    ("def f(a, b):\n    pass\n", "it needs a, b, but tpdiag calls it with no arguments"),
    # the compare exited 3 (an environment problem, DESIGN.md) and printed nothing
    ("import sys\ndef f():\n    sys.exit(3)\n", "calling it called sys.exit(3)"),
    ("import sys\nsys.exit(0)\ndef f():\n    pass\n", "called sys.exit(0): code at its top level ran on import"),
    # a script's top-level argparse read tpdiag's own arguments: its usage, then exit 2, no word of tpdiag's
    ("import argparse\np = argparse.ArgumentParser()\np.add_argument('--lr', type=float)\nargs = p.parse_args()\n"
     "def f():\n    return None\n", "returned NoneType, expected tpdiag.Target"),
])
def test_a_py_func_that_cannot_be_called_as_tpdiag_calls_it_is_one_line(code, needle, tmp_path):
    """What a user's FUNC does when tpdiag calls it - FUNC() on the meta device, before any world - is
    said in one line, exit 2, nothing written (hhouse23)."""
    (tmp_path / "user.py").write_text(code)
    r = runner.invoke(app, on_cpu(["compare", "--tp", "1,2", "--model", f"py:{tmp_path / 'user.py'}:f",
                                   "--out", str(tmp_path / "r")]))
    lines = [line for line in r.output.strip().splitlines() if line.strip()]
    assert r.exit_code == 2 and len(lines) == 1 and needle in lines[0], (r.exit_code, r.output)
    assert not (tmp_path / "r").exists()
