"""A rank that raises, dies or hangs fails its own degree; the others still report; exit 2."""
import json

from conftest import run_cli


def test_raising_rank_fails_only_its_degree(tmp_path):
    # no baseline rerun and no confirmation: neither is what this checks (a failed degree beside
    # one that still reports), and they were two more worlds; nor TP=4's own-input judgement
    # (a second pass of TP=1 and TP=4): that it still reports is its status
    p = run_cli("compare", "--tp", "1,2,4", "--out", str(tmp_path / "r"), "--format", "json",
                "--no-baseline", "--no-confirm", "--no-judge-downstream", env={"TPDIAG_FAULT": "raise:1@2"})
    assert p.returncode == 2, p.stderr
    s = json.loads(p.stdout)
    assert s["status"] == "inconclusive"
    assert s["degrees"]["2"]["status"] == "failed"
    assert "rank 1 raised RuntimeError: injected fault" in s["degrees"]["2"]["error"]
    assert s["degrees"]["4"]["status"] == "divergent"
    # the next step names the failed degree and where its ranks' tracebacks are (helper hnew15)
    todo = s["what_to_do"]
    assert todo.startswith("TP=2 failed, so nothing was compared there"), todo
    assert todo.endswith(str(tmp_path / "r" / "tp2" / "rank*.error")), todo
    assert list((tmp_path / "r" / "tp2").glob("rank*.error")), "the traceback it names is not there"


def test_hung_rank_times_out(tmp_path):
    # the TP=2 world waits out the whole timeout (idle): 8 s, where the TP=1 world of this tiny
    # model took 2.1 s of wall on the 2-core machine at load 15
    p = run_cli("compare", "--tp", "1,2", "--out", str(tmp_path / "r"), "--format", "json",
                "--timeout", "8", "--no-baseline", env={"TPDIAG_FAULT": "hang:0@2"})
    assert p.returncode == 2, p.stderr
    d = json.loads(p.stdout)["degrees"]["2"]
    assert d["status"] == "failed" and "timed out after 8 s" in d["error"]


def test_dying_rank_is_reported(tmp_path):
    p = run_cli("compare", "--tp", "1,2", "--out", str(tmp_path / "r"), "--format", "json",
                "--no-baseline", env={"TPDIAG_FAULT": "exit:1@2"})
    assert p.returncode == 2
    d = json.loads(p.stdout)["degrees"]["2"]
    assert d["status"] == "failed" and "rank 1 died (exit code 7)" in d["error"]
