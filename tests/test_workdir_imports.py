"""No module of the working directory runs in the CLI, the fork server or a rank (issue 58).

`tpdiag compare` is started from a directory that holds booby-trapped `tpdiag/` and `torch/`
packages (each writes a marker file and raises on import): the run completes and neither marker
exists. The fork server used to start as `python -c ...` with '' (the working directory) first on
sys.path, so its preloads - torch, tpdiag.runner.worker - came from there. PYTHONPATH set by the user
keeps working: it is how these tests reach this checkout's tpdiag.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import ROOT

TRAP = '''import os
open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "{name}-was-imported"), "w").close()
raise ImportError("the working directory's {name} was imported")
'''


def _trapped(tmp_path, names):
    work = tmp_path / "work"
    for name in names:
        (work / name).mkdir(parents=True)
        (work / name / "__init__.py").write_text(TRAP.format(name=name))
    return work


@pytest.mark.parametrize("how", ["console-script", "python -m tpdiag"])
def test_booby_trapped_packages_in_the_working_directory_never_run(tmp_path, how):
    if how == "console-script":
        # what the installed `tpdiag` command does: sys.path[0] is the script's own directory
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir()
        (bin_dir / "tpdiag_cmd.py").write_text("import sys\nfrom tpdiag.cli import main\n"
                                               "if __name__ == '__main__':\n    sys.exit(main())\n")
        work = _trapped(tmp_path, ["tpdiag", "torch"])
        cmd = [sys.executable, str(bin_dir / "tpdiag_cmd.py")]
    else:
        # `python -m` puts the working directory first itself; a tpdiag/ there would be the user's
        # own choice of package, so the trap is torch/ alone
        work = _trapped(tmp_path, ["torch"])
        cmd = [sys.executable, "-m", "tpdiag"]
    env = dict(os.environ, PYTHONPATH=ROOT, COLUMNS="160")
    # the console script runs a compare (the fork server and the ranks); `python -m` needs only a
    # command that imports torch in the CLI process itself
    args = (["compare", "--device", "cpu", "--tp", "1,2", "--forward-only", "--no-confirm", "--no-baseline", "--no-judge-downstream",
             "--out", str(tmp_path / "run")] if how == "console-script" else ["doctor"])
    p = subprocess.run([*cmd, *args], capture_output=True, text=True, cwd=work, env=env, timeout=600)
    imported = sorted(f.name for f in work.iterdir() if f.name.endswith("-was-imported"))
    assert imported == [], (imported, p.stdout[-2000:], p.stderr[-2000:])
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
