"""A rollout configuration whose world failed gave no logprobs: the verdict must not count it among
those tried and not matching (red team hred11: with TP=2's world killed, "not reproduced: no
configuration tried gives the engine's bits (tp 1,2, ...)" read as TP=2 ruled out)."""
import json

from typer.testing import CliRunner


def test_a_failed_configuration_is_named_in_the_verdict(tmp_path):
    from tpdiag.cli import app

    f = tmp_path / "r.jsonl"
    f.write_text(json.dumps({"input_ids": [1, 2, 3, 4, 5, 6], "prompt_len": 3, "logprobs": [-0.5, -0.25, -1.0]}) + "\n")
    r = CliRunner().invoke(app, ["rollout", str(f), "--model", "py:tests/models/planted/crash_tp2.py:target",
                                 "--tp", "1,2", "--mode", "prefill", "--micro-batch", "1", "--fix", "none",
                                 "--device", "cpu", "--format", "json"])
    # DESIGN.md: a world failed -> exit 2 (it was 0: the run as asked for is incomplete); the JSON
    # report still comes on stdout, one `inconclusive:` line on stderr
    assert r.exit_code == 2, r.output
    assert "inconclusive: 1 configuration failed and gave no logprobs (tp2-mb1-prefill-none" in r.stderr, r.stderr
    s = json.loads(r.stdout)
    assert s["configurations"]["tp2-mb1-prefill-none"]["status"] == "failed", s["configurations"]
    assert s["configurations"]["tp1-mb1-prefill-none"].get("status") != "failed"
    words = s["closest"]["explanation"]
    assert not s["closest"]["reproduced"]
    assert "1 of them failed and are not compared (tp2-mb1-prefill-none" in words, words
