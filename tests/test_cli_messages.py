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
    from tpdiag.models.plans import HF_VARIANTS, VARIANTS
    from tpdiag.models.presets import PRESETS

    opts = {p.name: p.help for p in _commands()["compare"].params}
    for preset in PRESETS:
        assert preset in opts["model"]
    for v in VARIANTS + HF_VARIANTS:
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


def test_version_is_the_package_metadata():
    from importlib import metadata

    import tpdiag

    want = metadata.version("tpdiag")
    assert tpdiag.__version__ == want
    p = run_cli("--version", timeout=120)
    assert p.returncode == 0 and p.stdout == f"tpdiag {want}\n", p.stdout + p.stderr
    # `import tpdiag` stays cheap: the metadata is read on first use of __version__ only
    p = subprocess.run([sys.executable, "-c", "import sys, tpdiag; print(sorted({'torch', 'importlib.metadata'} "
                        "& set(sys.modules)))"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert p.stdout.strip() == "[]", p.stdout + p.stderr


def _words(text: str) -> list[str]:
    return " ".join(text.split()).split(" ")


def test_help_piped_keeps_every_sentence_on_one_line():
    p = run_cli("--help", timeout=120)
    assert p.returncode == 0 and "..." not in p.stdout.split("Commands:")[1], p.stdout
    for name, cmd in _commands().items():
        first = cmd.help.split("\n\n")[0]
        assert re.search(rf"^  {name} +{re.escape(' '.join(first.split()))}$", p.stdout, re.M), (name, p.stdout)
    p = run_cli("compare", "--help", env={"COLUMNS": "60"}, timeout=120)
    for o in _commands()["compare"].params:
        if o.help:  # the whole help of each option on its option's line
            assert any(" ".join(o.help.split()) in ln for ln in p.stdout.splitlines()), o.name


def test_help_on_a_narrow_terminal_wraps_at_spaces_only():
    from tpdiag.cli.options import _Context

    for name, cmd in [("", typer.main.get_command(app)), *_commands().items()]:
        ctx = _Context(cmd, info_name=f"tpdiag {name}".strip(), terminal_width=60, max_content_width=60)
        text = cmd.get_help(ctx)
        assert "..." not in text.split("\n", 1)[1] and "\u2026" not in text, text
        long = [ln for ln in text.splitlines() if len(ln) > 60]
        # a line runs past 60 columns only where one unbreakable word does not fit
        assert all(" " not in ln.strip().split("  ")[-1] for ln in long), long
        for p in cmd.params:  # every word of every option's help, whole: nothing broken at a hyphen
            for w in _words(p.help or "") if p.param_type_name == "option" else ():
                assert w in _words(text), (name, p.name, w)


def test_fixes_table_never_cuts_a_name():
    import io

    from rich.console import Console

    from tpdiag.cli.tables import fixes_table
    from tpdiag.fixes.registry import catalogue

    rows = [f.to_dict() for f in catalogue().values()]
    for width in (60, 100, 250):  # terminals: too narrow for the table, and wide enough
        buf = io.StringIO()
        fixes_table(Console(file=buf, force_terminal=True, width=width, color_system=None), rows)
        text = buf.getvalue()
        assert "\u2026" not in text and "..." not in text, text
        for r in rows:
            for w in _words(", ".join(r["ops"])) + _words(", ".join(r["fixes"])) + [r["name"]]:
                assert w in text, (width, w)
    p = run_cli("fixes", env={"COLUMNS": "80"}, timeout=120)  # piped: one line per fix, whole cost
    for r in rows:
        line = next(ln for ln in p.stdout.splitlines() if ln.startswith(r["name"] + " "))
        assert " ".join(r["cost"].split()) in line and ", ".join(r["ops"]) in line, line


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
        # module-granularity violations (no op): the words say module, never 'op -'; counts agree in number
        assert out[0] == "gate: FAIL - first divergent module beyond policy: " + v("2", "layers.0.attention.wo").line()
        assert "op -" not in "\n".join(out) and " op " not in out[0]
        assert "TP=2: fail (2 records beyond policy; the first is in the headline)" in out
        assert "TP=4: fail (1 record beyond policy)" in out
        for d in res.degrees.values():
            for x in d.violations:
                assert sum(x.line() in ln for ln in out) == 1, "\n".join(out)
        assert out[1].startswith(f"policy: {policy.source} (") and hint in out[1] and "docs/ci.md" in out[1]
        assert res.exit_code == 1
    # an op-granularity violation names its op, and the headline says op
    op = Violation("2", "forward", "layers.0.attention.wq", "aten::mm", "out", "0", "shape-dependent-gemm", 3,
                   1e-8, "beyond budget")
    res = GateResult("run", Policy(), reference="1", degrees={"2": DegreeResult("2", "fail", 1, [op])})
    assert res.lines()[0].startswith("gate: FAIL - first divergent op beyond policy: TP=2: module "
                                     "layers.0.attention.wq (the difference enters at op aten::mm), phase forward")
    ok = GateResult("run", Policy(), reference="1", degrees={"2": DegreeResult("2", "pass", 1)})
    assert "TP=2: pass (1 divergent record within policy)" in ok.lines()


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
    from tpdiag.cli.doctor import BAD, INFO, OK, assess

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
    assert "baseline: reference not rerun against itself (--no-baseline)" in p.stdout
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

    from tpdiag.cli.progress import progress
    from tpdiag.config import CompareConfig

    cfg = CompareConfig.of(degrees=(1, 2))
    for terminal, quiet, shown in ((True, False, True), (True, True, False), (False, False, False)):
        buf = io.StringIO()
        with progress(Console(file=buf, force_terminal=terminal, width=100), cfg, quiet) as on_status:
            on_status("2", "running")
            on_status("2", "ok")
        assert ("TP=2" in buf.getvalue()) == shown, (terminal, quiet, buf.getvalue())


def test_a_decode_world_shows_its_calls_on_the_status_line(tmp_path):
    """A decode world's rank 0 writes how far its calls are (runner/progress.py, at most once a
    second); the live status line shows it beside the world's timer."""
    import io

    import torch
    from rich.console import Console

    from tpdiag.cli.progress import progress as live
    from tpdiag.config import CompareConfig
    from tpdiag.models import tiny_llama
    from tpdiag.probes.recorder import Recorder
    from tpdiag.runner import piece, progress

    torch.manual_seed(0)
    model = tiny_llama.build("tiny-llama", n_layers=1)
    ids = torch.randint(0, 512, (1, 8))
    with torch.no_grad():
        piece._decode(model, ids, Recorder(enabled=False), report=progress.Reporter(str(tmp_path), 0))
    assert progress.read(str(tmp_path)) == "decode call 1 of 5"  # the first call's; then a second apart
    assert progress.Reporter(str(tmp_path), 1).path is None  # rank 0 only
    progress.clear(str(tmp_path))
    assert progress.read(str(tmp_path)) is None
    buf = io.StringIO()
    with live(Console(file=buf, force_terminal=True, width=120), CompareConfig.of(degrees=(1, 2))) as on_status:
        on_status("2", "running")
        on_status("2", "running:decode call 3 of 9")
    assert "running, decode call 3 of 9" in buf.getvalue()


@pytest.mark.parametrize("manifest,needle", [
    ({"schema": 1, "tool": "tpdiag.capture", "complete": True}, "a capture of tpdiag.capture, not a run directory"),
    ({"schema": 1, "tool": "wandb"}, "written by 'wandb', not by tpdiag compare or tpdiag diff"),
    ([1, 2], "manifest.json: not a JSON object"),
])
@pytest.mark.parametrize("cmd", ["gate", "report"])
def test_a_capture_or_another_tools_directory_is_named_so(cmd, manifest, needle, tmp_path):
    """Each read `DIR/summary.json: missing` (red team hred21): true, but it said nothing of what the
    directory is. One line, exit 2, and nothing written into the directory."""
    d = tmp_path / "d"
    d.mkdir()
    (d / "manifest.json").write_text(json.dumps(manifest))
    before = sorted(p.name for p in d.iterdir())
    r = runner.invoke(app, [cmd, str(d), *(["-o", str(tmp_path / "r.html")] if cmd == "report" else [])])
    assert r.exit_code == 2, r.output
    assert needle in r.output.splitlines()[0], r.output
    assert "Traceback" not in r.output and "summary.json: missing" not in r.output, r.output
    assert sorted(p.name for p in d.iterdir()) == before
