"""README.md's "What you see" block is what tpdiag prints: it was generated from a real run by
examples/readme_output.py, and fails here when the output format changes (rerun that script)."""
import json
import os
import re
import sys

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "examples"))
import readme_output  # noqa: E402


def _stored():
    with open(readme_output.STORED) as f:
        return json.load(f)


def _readme_block():
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    a, b = text.index(readme_output.BEGIN) + len(readme_output.BEGIN), text.index(readme_output.END)
    return text[a:b]


def test_readme_block_is_the_current_rendering_of_a_real_run():
    assert _readme_block().strip() == readme_output.block(_stored()).strip(), (
        "README.md's 'What you see' is stale: run python examples/readme_output.py")


def _shape(line: str) -> str:
    """A printed line with its numbers and names blanked: what must not drift."""
    line = re.sub(r"[-+]?\d+(\.\d+)?(e[-+]\d+)?", "N", line)
    return re.sub(r"\s+", " ", line).strip()


def test_a_fresh_run_prints_the_readme_shape(tp12_run):
    from tpdiag.cli.render import render_text

    with open(os.path.join(tp12_run, "summary.json")) as f:
        fresh = render_text(json.load(f)).splitlines()
    shown = readme_output.block(_stored()).split("```")[1].strip().splitlines()
    header = next(ln for ln in shown if ln.startswith("TP "))  # column widths follow the contents
    assert _shape(header) in [_shape(ln) for ln in fresh], "\n".join(fresh)
    for prefix in ("verdict:", "ran:", "baseline:"):
        want = next(ln for ln in shown if ln.startswith(prefix))
        got = next((ln for ln in fresh if ln.startswith(prefix)), None)
        assert got is not None and _shape(got) == _shape(want), (want, got)
    want_row = next(ln for ln in shown if re.match(r"2\s", ln))
    got_row = next(ln for ln in fresh if re.match(r"2\s", ln))
    # same columns in the same order: the status, a 'phase: module' cell, a cause, 'abs / bound'
    cols = r"^2\s+(bitwise|divergent)\s+\S+: \S+.*\s+[a-z-]+\s+\S+ / \S+\s+\d+\s+\S+ \(x[\d.]+\)$"
    assert re.match(cols, want_row) and re.match(cols, got_row), (want_row, got_row)
