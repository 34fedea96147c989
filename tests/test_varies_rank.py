"""A per-rank buffer nobody reads, beside a module whose result varies per rank by itself (helper
hbug14; tests/models/planted/varies_rank.py, --steps 2).

diff/replicas.py's "beside" rule reads a buffer as read where the next step's first record that
differs across ranks is a module's forward output on inputs and parameters the same on every rank.
A kernel whose result varies per rank (a nondeterministic GPU kernel; simulated on the CPU by a
reduction in the rank's own order, `Combine`) makes that true of every step, so every unread
per-rank buffer read `rank-inconsistent-replica`, a BUG of its own: on main at da9eec2 the logged
observer's buffer did, at step 0 ("step 1 reads per-rank state: combine's forward output...") and at
the last step (no later step). Where that module's ranks differed on the same inputs already before
the buffer's did, its split shows nothing about the buffer: `unknown`, with that reason, at both
steps. A reader shown (read_beside: `Scale`, before the combine, multiplies by the buffer) stays BUG.
"""
import json

import pytest

from conftest import run_cli

SPEC = "py:tests/models/planted/varies_rank.py:"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for case in ("logged_varies", "read_beside"):
        d = tmp_path_factory.mktemp(case) / "r"
        p = run_cli("compare", "--model", SPEC + case, "--tp", "1,2", "--steps", "2", "--no-baseline",
                    "--no-confirm", "--out", str(d), env={"OMP_NUM_THREADS": "1"})
        assert p.returncode == 0, (case, p.stderr[-3000:] + p.stdout[-2000:])
        s = json.loads((d / "summary.json").read_text())
        out[case] = {f["step"]: f for f in s["degrees"]["2"]["findings"] if f["kind"] == "buffer"}
    return out


def test_an_unread_buffer_beside_a_module_that_varies_per_rank_is_unknown(runs):
    buf = runs["logged_varies"]
    assert set(buf) == {0, 1}, buf
    for step, f in buf.items():
        assert f["cause"] == "unknown", (step, f)
        assert "combine" in f["why"] and "varies per rank" in f["why"], (step, f["why"])


def test_a_buffer_a_module_is_shown_to_read_stays_a_bug(runs):
    f = runs["read_beside"][0]
    assert f["cause"] == "rank-inconsistent-replica", f
    assert "step 1 reads per-rank state: scale's forward output" in f["why"], f["why"]
