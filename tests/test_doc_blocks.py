"""The code blocks of docs/training.md and docs/capture.md run as written: each page's python
blocks, in order, are one script (the page says so), run under torchrun with 1 and 2 processes
(gloo, CPU) in a scratch directory; every rank must exit 0 and the capture page must leave
complete captures behind."""
from __future__ import annotations

import json
import os
import re

import pytest

from conftest import ROOT, run_module


def page_script(page: str) -> str:
    text = open(os.path.join(ROOT, "docs", page)).read()
    blocks = re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)
    assert blocks, page
    return "\n".join(blocks)


@pytest.mark.parametrize("page", ["training.md", "capture.md"])
@pytest.mark.parametrize("nproc", [1, 2])
def test_page_runs_as_written(page, nproc, tmp_path):
    script = tmp_path / "page.py"
    script.write_text(page_script(page))
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    p = run_module("torch.distributed.run", "--standalone",
                   "--nproc-per-node", str(nproc), str(script), env=env, cwd=tmp_path, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-4000:]
    if page == "capture.md":
        for d in (f"cap-tp{nproc}", f"step0-tp{nproc}"):
            m = json.loads((tmp_path / "runs" / d / "manifest.json").read_text())
            assert m["complete"] and m["degree"] == nproc, (d, m)
