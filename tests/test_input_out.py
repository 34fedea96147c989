"""An output directory is never taken over from another run (records/run_files.check_out):
`tpdiag diff --out` into a compare run replaced its manifest.json and summary.json with the
diff's; `tpdiag.capture(out=...)` unlinked the manifest it found; compare wrote over a diff's or a
user's manifest.json. Each is refused in one line before anything runs; an earlier run of the same
command is still replaced (README). No world: in-process and CliRunner checks only."""
import json

import pytest
import torch
from typer.testing import CliRunner

from conftest import on_cpu
from tpdiag.cli import app
from tpdiag.errors import BadInput
runner = CliRunner()


def _run_dir(path, tool):
    path.mkdir()
    manifest = {"schema": 1, "tool": tool} if tool else {"name": "my experiment"}
    (path / "manifest.json").write_text(json.dumps(manifest))
    (path / "summary.json").write_text(json.dumps({"schema": 1, "status": "bitwise"}))
    return (path / "manifest.json").read_bytes(), (path / "summary.json").read_bytes()


@pytest.mark.parametrize("held,tool,needle", [
    ("tpdiag compare", "tpdiag diff", "holds a tpdiag compare run; this tpdiag diff would replace its manifest.json"),
    ("tpdiag compare", "tpdiag.capture", "holds a tpdiag compare run; this tpdiag.capture would replace"),
    ("tpdiag diff", "tpdiag compare", "holds a tpdiag diff output; this tpdiag compare would replace"),
    ("tpdiag.capture", "tpdiag compare", "holds a tpdiag.capture directory; this tpdiag compare would replace"),
    (None, "tpdiag compare", "holds a manifest.json that no tpdiag run wrote; this tpdiag compare would replace it"),
])
def test_check_out_refuses_another_runs_directory(tmp_path, held, tool, needle):
    from tpdiag.records.run_files import check_out

    _run_dir(tmp_path / "d", held)
    with pytest.raises(BadInput, match="^--out .*: " + needle.replace(".", r"\.")):
        check_out(str(tmp_path / "d"), tool)


def test_check_out_lets_through_what_loses_nothing(tmp_path):
    from tpdiag.records.run_files import check_out

    check_out(str(tmp_path / "new"), "tpdiag compare")  # not there yet
    (tmp_path / "empty").mkdir()
    check_out(str(tmp_path / "empty"), "tpdiag diff")
    _run_dir(tmp_path / "again", "tpdiag compare")
    check_out(str(tmp_path / "again"), "tpdiag compare")  # an earlier compare: replaced, as README says
    (tmp_path / "f").write_text("x")
    with pytest.raises(BadInput, match="exists and is not a directory"):
        check_out(str(tmp_path / "f"), "tpdiag diff")


def test_diff_out_into_a_compare_run_is_refused_before_reading_anything(tmp_path):
    from tpdiag.diff.runs import diff_runs

    before = _run_dir(tmp_path / "run", "tpdiag compare")
    # the sides are not even read: the refusal comes first (they do not exist here)
    with pytest.raises(BadInput, match="holds a tpdiag compare run"):
        diff_runs(str(tmp_path / "run" / "tp1"), str(tmp_path / "run" / "tp2"), out=str(tmp_path / "run"))
    assert ((tmp_path / "run" / "manifest.json").read_bytes(), (tmp_path / "run" / "summary.json").read_bytes()) == before


def test_diff_out_a_file_is_one_line(tmp_path):
    (tmp_path / "f").write_text("x")
    r = runner.invoke(app, ["diff", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "f")])
    assert r.exit_code == 2 and r.output.strip().splitlines() == [
        f"error: --out '{tmp_path / 'f'}': exists and is not a directory"], r.output  # was FileExistsError


def test_compare_out_into_a_diff_output_is_refused(tmp_path):
    before = _run_dir(tmp_path / "d", "tpdiag diff")
    r = runner.invoke(app, on_cpu(["compare", "--tp", "1,2", "--out", str(tmp_path / "d")]))
    assert r.exit_code == 2, r.output
    lines = [line for line in r.output.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and "holds a tpdiag diff output" in lines[0], r.output
    assert ((tmp_path / "d" / "manifest.json").read_bytes(), (tmp_path / "d" / "summary.json").read_bytes()) == before


def test_capture_into_a_compare_run_keeps_its_manifest(tmp_path):
    import tpdiag

    before = _run_dir(tmp_path / "run", "tpdiag compare")
    with pytest.raises(BadInput, match=r"^capture\(out=\.\.\.\) .*holds a tpdiag compare run"):
        with tpdiag.capture(torch.nn.Linear(4, 4), out=str(tmp_path / "run")):
            pass
    assert ((tmp_path / "run" / "manifest.json").read_bytes(), (tmp_path / "run" / "summary.json").read_bytes()) == before


@pytest.mark.parametrize("args", [["report", "{run}", "-o", "{f}/r.html"],
                                  ["gate", "{run}", "--allow", "rounding", "--junit", "{f}/sub/j.xml"]])
def test_an_output_path_through_a_file_names_that_file(tp12_run, tmp_path, args):
    (tmp_path / "f").write_text("x")
    r = runner.invoke(app, [a.format(run=tp12_run, f=tmp_path / "f") for a in args])
    lines = [line for line in r.output.strip().splitlines() if line.strip()]
    assert r.exit_code == 2 and len(lines) == 1, r.output
    assert lines[0].endswith(f"cannot write ({tmp_path / 'f'} is a file, not a directory)"), r.output  # was 'File exists'
    assert (tmp_path / "f").read_text() == "x"


def test_an_out_that_cannot_be_created_is_one_line(tmp_path):
    """compare and diff --out under a file: 'error: NotADirectoryError: [Errno 20] ...' before."""
    (tmp_path / "f").write_text("x")
    out = tmp_path / "f" / "run"
    r = runner.invoke(app, on_cpu(["compare", "--tp", "1,2", "--out", str(out)]))
    assert r.exit_code == 2 and r.output.strip().splitlines() == [
        f"error: --out {out}: cannot create it ({tmp_path / 'f'} is a file, not a directory)"], r.output
    from tpdiag.diff.runs import diff_runs

    with pytest.raises(BadInput, match=r"cannot create it \(.* is a file, not a directory\)"):
        diff_runs(str(tmp_path / "a"), str(tmp_path / "b"), out=str(out))


@pytest.mark.parametrize("args,what", [(["report", "{run}", "-o", "{f}"], "a tpdiag report"),
                                       (["gate", "{run}", "--allow", "rounding", "--junit", "{f}"],
                                        "a JUnit file tpdiag gate wrote")])
def test_an_output_file_tpdiag_did_not_write_is_never_written_over(tp12_run, tmp_path, args, what):
    """`report -o model.py` wrote the page over the user's file, and `gate --junit` over any file it
    named, exit 0 (hhouse23); an earlier page or JUnit file of tpdiag's, or an empty file, is replaced."""
    user = tmp_path / "model.py"
    user.write_text("def target():\n    ...\n")
    r = runner.invoke(app, [a.format(run=tp12_run, f=user) for a in args])
    lines = [line for line in r.output.strip().splitlines() if line.strip()]
    assert r.exit_code == 2 and len(lines) == 1, r.output
    assert f"'{user}': exists and is not {what}; name a new file" in lines[0], r.output
    assert user.read_text() == "def target():\n    ...\n"
    mine = tmp_path / "out"
    mine.write_text("")
    for _ in range(2):  # empty, then tpdiag's own from the first pass
        r = runner.invoke(app, [a.format(run=tp12_run, f=mine) for a in args])
        assert r.exit_code == 0, r.output
        assert mine.stat().st_size > 0


@pytest.mark.parametrize("name", ["summary.json", "diff.csv", "report.html"])
def test_compare_never_writes_over_a_users_files_in_a_directory_that_is_no_run(tmp_path, name):
    """A directory with no manifest.json is no run of tpdiag's (compare writes it first): a compare
    --out there wrote its summary.json and diff.csv over the user's and removed their report.html,
    exit 0 (hhouse23). Refused in one line before anything runs; a directory of other files is not."""
    d = tmp_path / "mine"
    d.mkdir()
    (d / name).write_text("the user's own")
    r = runner.invoke(app, on_cpu(["compare", "--tp", "1,2", "--out", str(d)]))
    lines = [line for line in r.output.strip().splitlines() if line.strip()]
    assert r.exit_code == 2 and len(lines) == 1 and f"holds {name} but no manifest.json" in lines[0], r.output
    assert (d / name).read_text() == "the user's own" and sorted(p.name for p in d.iterdir()) == [name]
    from tpdiag.records.run_files import check_out

    (d / name).unlink()
    (d / "notes.txt").write_text("x")
    check_out(str(d), "tpdiag compare")  # nothing a compare writes: let through, as before
