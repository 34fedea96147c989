"""What a new user reads: option help from the code's own tables, plain output off a terminal,
one-line messages for a directory that is not a run, the gate's violations once, doctor's verdicts.
Most tests need no world; one tiny compare (TP=1,2, forward only) checks piped output end to end."""
import json
import re
import subprocess
import sys

import pytest
import typer.main
from typer.testing import CliRunner

from conftest import ROOT, run_cli
from tpdiag.cli import app

runner = CliRunner()
BOX = re.compile("[\u2500-\u257f\u2580-\u259f\u2800-\u28ff]")  # box drawing, blocks, braille spinner


def _commands():
    return typer.main.get_command(app).commands


def test_every_option_of_every_command_has_help():
    for name, cmd in _commands().items():
        for p in cmd.params:
            if p.param_type_name == "option":
                assert p.help and p.help.strip(), f"tpdiag {name} {p.opts[0]} has no help"
            else:  # click drops typer's argument help: the command's own help explains each argument
                assert f"{p.name.upper()}:" in (cmd.help or ""), f"tpdiag {name} argument {p.name} unexplained"


def test_help_lists_exactly_what_the_code_accepts():
    from tpdiag import config
    from tpdiag.fixes.registry import catalogue
    from tpdiag.models.plans import VARIANTS
    from tpdiag.models.presets import PRESETS

    opts = {p.name: p.help for p in _commands()["compare"].params}
    for preset in PRESETS:
        assert preset in opts["model"]
    for v in VARIANTS:
        assert v in opts["variant"] and v in opts["variants"]
    for f in catalogue():
        assert f in opts["fix"]
    for table, opt in (("DTYPES", "dtype"), ("DEVICES", "device"), ("GRANULARITIES", "granularity"),
                       ("CAPTURES", "capture"), ("FORMATS", "fmt")):
        for choice in getattr(config, table):
            assert choice in opts[opt], (opt, choice)


def test_import_cli_stays_cheap():
    p = subprocess.run([sys.executable, "-c", "import sys, tpdiag.cli; print('torch' in sys.modules)"],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "False", p.stdout + p.stderr


def test_help_piped_is_plain():
    p = run_cli("compare", "--help", timeout=120)
    assert p.returncode == 0 and "--variant" in p.stdout
    assert not BOX.search(p.stdout) and "\x1b" not in p.stdout


def _one_line(r, code, *needles):
    assert r.exit_code == code, r.output
    lines = [ln for ln in r.output.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, r.output
    for n in needles:
        assert n in lines[0], r.output
    assert "Traceback" not in r.output


@pytest.mark.parametrize("cmd", ["report", "confirm"])
def test_not_a_run_directory_is_one_line(cmd, tmp_path):
    _one_line(runner.invoke(app, [cmd, str(tmp_path)]), 2, "not a run directory (no manifest.json)",
              "tpdiag compare --out DIR")


@pytest.mark.parametrize("cmd", ["report", "confirm", "gate"])
def test_missing_path_names_the_command_that_makes_one(cmd, tmp_path):
    r = runner.invoke(app, [cmd, str(tmp_path / "nope")])
    assert r.exit_code == 2, r.output
    assert "not a directory (does not exist)" in r.output and "tpdiag compare --out DIR" in r.output


def test_gate_on_a_non_run_directory_is_inconclusive_and_says_so(tmp_path):
    r = runner.invoke(app, ["gate", str(tmp_path)])
    assert r.exit_code == 2, r.output
    first = r.output.splitlines()[0]
    assert first.startswith("gate: INCONCLUSIVE - ") and "not a run directory" in first
    assert "tpdiag compare --out DIR" in first


def test_diff_on_non_captures_names_tpdiag_capture(tmp_path):
    (tmp_path / "a").mkdir()
    _one_line(runner.invoke(app, ["diff", str(tmp_path / "a"), str(tmp_path / "a")]), 2,
              "not a capture directory", "tpdiag.capture(model, out=DIR)")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "manifest.json").write_text(json.dumps({"schema": 1, "tool": "tpdiag compare"}))
    _one_line(runner.invoke(app, ["diff", str(tmp_path / "run"), str(tmp_path / "run")]), 2,
              "a tpdiag compare run directory: name one of its degrees", "RUN_DIR/tpN")


def test_gate_prints_each_violation_once_and_points_to_the_policy_doc():
    # GateResult.lines() is all the text gate prints; built by hand, no world needed (the CLI path
    # on a real run is tests/test_gate.py's).
    from tpdiag.gate import DegreeResult, GateResult, Policy, Violation

    def v(deg, mod):
        return Violation(deg, "forward", mod, None, "out", "0", "row-parallel-reduction", 12, 3e-8, "beyond budget")

    for policy, hint in ((Policy(), "--policy FILE.toml"), (Policy(source="p.toml"), "format")):
        res = GateResult("run", policy, reference="1", degrees={
            "2": DegreeResult("2", "fail", 3, [v("2", "layers.0.attention.wo"), v("2", "layers.0.feed_forward.w2")]),
            "4": DegreeResult("4", "fail", 1, [v("4", "layers.0.attention.wo")])})
        out = res.lines()
        assert out[0] == "gate: FAIL - first divergent op beyond policy: " + v("2", "layers.0.attention.wo").line()
        for d in res.degrees.values():
            for x in d.violations:
                assert sum(x.line() in ln for ln in out) == 1, "\n".join(out)
        assert out[1].startswith(f"policy: {policy.source} (") and hint in out[1] and "docs/ci.md" in out[1]
        assert res.exit_code == 1


def test_doctor_gives_a_verdict_per_line():
    p = run_cli("doctor", timeout=300)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.strip().splitlines()
    verdicts = ("ok:", "will make results non-reproducible:", "informational:")
    assert all(any(v in ln for v in verdicts) for ln in lines[:-1]), p.stdout
    assert lines[-1].startswith("doctor: ")
    assert "{" not in p.stdout and not BOX.search(p.stdout)
    assert any(ln.startswith("deterministic algorithms") for ln in lines)


def test_doctor_flags_settings_that_break_reproducibility():
    from tpdiag.doctor import BAD, INFO, OK, assess

    base = {"versions": {"torch": "x"}, "gloo": True, "tf32_matmul": False, "deterministic_algorithms": True}
    assert {c.verdict for c in assess({**base, "numerics_env": {}})} <= {OK, INFO}
    bad = assess({**base, "numerics_env": {"TPDIAG_DETERMINISM": "warn", "CUBLAS_WORKSPACE_CONFIG": ":0:0",
                                           "NCCL_ALGO": "Tree"}})
    by = {c.name: c.verdict for c in bad}
    assert by["env TPDIAG_DETERMINISM"] == BAD and by["env CUBLAS_WORKSPACE_CONFIG"] == BAD
    assert by["env NCCL_ALGO"] == INFO


def test_fixes_piped_is_plain_and_points_to_the_causes_doc():
    p = run_cli("fixes", timeout=120)
    assert p.returncode == 0 and "tp-invariant-linear" in p.stdout
    assert not BOX.search(p.stdout) and "\x1b" not in p.stdout and "docs/causes.md" in p.stdout


def test_piped_compare_is_plain_and_says_how_many_steps_ran(tmp_path):
    out = tmp_path / "run"
    p = run_cli("compare", "--tp", "1,2", "--steps", "2", "--forward-only", "--no-confirm", "--no-baseline",
                "--seq-len", "8", "--out", str(out), timeout=600)
    assert p.returncode == 0, p.stderr + p.stdout
    assert not BOX.search(p.stdout + p.stderr) and "\x1b" not in p.stdout + p.stderr
    assert p.stderr.strip() == "", p.stderr  # no progress / spinner lines off a terminal
    assert "ran: 2 steps at each degree (forward only)" in p.stdout
    assert re.search(r"^TP\s+status\s+first divergence\s+cause", p.stdout, re.M), p.stdout
    s = json.loads((out / "summary.json").read_text())
    assert s["steps"] == 2 and s["backward"] is False


def test_docs_explain_every_cause_and_fix_the_code_knows():
    import os

    from tpdiag.diff.locate import CAUSES
    from tpdiag.fixes.registry import catalogue

    with open(os.path.join(ROOT, "docs", "causes.md")) as f:
        text = f.read()
    for name in (*CAUSES, *catalogue()):
        assert f"`{name}`" in text, name


def test_docs_index_links_every_page_and_nothing_cites_missing_files():
    import glob
    import os

    with open(os.path.join(ROOT, "docs", "README.md")) as f:
        index = f.read()
    pages = [os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "docs", "*.md"))]
    for page in pages:
        if page != "README.md":
            assert f"({page})" in index, page
    for path in [os.path.join(ROOT, "README.md"), *glob.glob(os.path.join(ROOT, "docs", "*.md"))]:
        with open(path) as f:
            text = f.read()
        assert "BACKGROUND.md" not in text, path
        for link in re.findall(r"\]\(([^)#]+\.md)\)", text):
            assert os.path.isfile(os.path.join(os.path.dirname(path), link)), (path, link)


def test_progress_shows_on_a_terminal_only():
    import io

    from rich.console import Console

    from tpdiag.cli_render import progress
    from tpdiag.config import CompareConfig

    cfg = CompareConfig(degrees=(1, 2))
    for terminal, quiet, shown in ((True, False, True), (True, True, False), (False, False, False)):
        buf = io.StringIO()
        with progress(Console(file=buf, force_terminal=terminal, width=100), cfg, quiet) as on_status:
            on_status("2", "running")
            on_status("2", "ok")
        assert ("TP=2" in buf.getvalue()) == shown, (terminal, quiet, buf.getvalue())
