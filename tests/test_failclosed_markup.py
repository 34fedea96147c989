"""Fail closed, round 4: strings of the run print as text. A py: model's module named `down[/]x` (torch
allows any name without a dot) was read as rich markup by compare's verdict lines: on main the run
finished and was then lost to `error: MarkupError: closing tag '[/]' ...` (exit 2), and `[bold]` in a
name was silently dropped from it. Any error message quoting such a name or path (`tpdiag report
'DIR[/]x'`) was replaced by the same MarkupError line. The report page escapes them as HTML.
"""
import pytest

from conftest import run_cli


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("markup") / "run"
    p = run_cli("compare", "--model", "py:tests/models/markup_names.py:target", "--tp", "1,2", "--forward-only",
                "--no-confirm", "--no-baseline", "--batch-size", "1", "--seq-len", "4", "--out", str(out))
    return out, p


def test_compare_prints_the_names_as_they_are(run):
    out, p = run
    assert p.returncode == 0 and "MarkupError" not in p.stderr, p.stderr + p.stdout
    assert "forward: blocks.down[/]x" in p.stdout, p.stdout
    assert "rounding at forward: blocks.down[/]x" in p.stdout, p.stdout


def test_the_report_escapes_them(run, tmp_path):
    out, _ = run
    p = run_cli("report", str(out), "-o", str(tmp_path / "r.html"))
    assert p.returncode == 0, p.stderr
    html = (tmp_path / "r.html").read_text()
    assert "blocks.up[bold]&lt;script&gt;" in html and "up[bold]<script>" not in html


def test_an_error_quoting_markup_prints_its_own_words(tmp_path):
    p = run_cli("report", str(tmp_path / "no[/]such"))
    assert p.returncode == 2 and "MarkupError" not in p.stderr, p.stderr
    assert f"RUN_DIR '{tmp_path / 'no[/]such'}': not a directory" in p.stderr, p.stderr
