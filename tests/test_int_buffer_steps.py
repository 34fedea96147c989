"""An integer buffer a later step's forward reads, with the later steps re-anchored (the default):
tests/models/planted/int_buffer.py, `down`'s warm-up scale ramped in by a token count kept in a long
buffer, --tp 1,2 --steps 2. The anchor loads the reference's parameters, AdamW moments and floating
buffers before step 1 and leaves integer buffers each world's own (runner/anchor.py): integer buffers
are not recorded (probes/model_walk records the floating ones a step wrote), so a count a world
advanced wrongly shows only where a later step's forward reads it. Loading the reference's count
erased that symptom: with integer buffers loaded too, `seen_width` (each rank counts its column
shard's elements, half the tokens) read rounding only, gate 0 with --allow rounding, its step-1
forward bitwise the reference's. Kept its own, it reads BUG at step 1 at `down` (the float64
re-execution 2.7e5x beyond rounding), gate 4; its correct twin `seen_tokens` reads rounding."""
import json

import pytest
import torch

from conftest import compare_planted

CASES = {c: ("int_buffer", c, ("--tp", "1,2", "--steps", "2")) for c in ("seen_tokens", "seen_width")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return compare_planted(tmp_path_factory, CASES)


def test_the_correct_count_reads_rounding_with_step_1_anchored(runs):
    s, stdout, gate = runs["seen_tokens"]
    assert s["anchor"] is True and "each later step from the reference's state" in stdout, stdout
    assert s["class"] == "rounding" and s["degrees"]["2"]["class"] == "rounding", s["degrees"]["2"].get("findings")
    assert gate == 1, stdout  # rounding: the gate's own exit for it


def test_a_count_advanced_per_shard_is_a_bug_at_the_step_that_reads_it(runs):
    s, stdout, gate = runs["seen_width"]
    d = s["degrees"]["2"]
    assert s["class"] == "bug" and gate == 4, stdout
    bugs = [f for f in [d["first_divergence"], *d.get("findings", ())] if f.get("cause") == "sharding-bug"]
    # step 0 read 0 at both sides; step 1's forward of `down` reads the count step 0 wrote
    assert bugs and min(f["step"] for f in bugs) == 1, bugs
    first = next(f for f in bugs if f["step"] == 1 and f.get("phase") == "forward" and f.get("module") == "down")
    assert (first.get("oracle") or {}).get("far"), first


def test_the_anchor_keeps_a_worlds_integer_buffer_its_own(tmp_path):
    """runner/anchor.save writes no integer buffer and load replaces none; the floating state loads."""
    import importlib.util
    import os

    from safetensors.torch import load_file

    from tpdiag.runner import anchor

    path = os.path.join(os.path.dirname(__file__), "models", "planted", "int_buffer.py")
    spec = importlib.util.spec_from_file_location("int_buffer_t", path)
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    torch.manual_seed(0)
    ref = m.MLPLM(m.WarmTokens)
    ref.down.seen.fill_(32)
    torch.manual_seed(1)
    here = m.MLPLM(m.WarmTokens)
    here.down.seen.fill_(16)
    f = anchor.state_file(str(tmp_path), 1)
    anchor.save(f, ref, None)
    assert "buffers:down.seen" not in load_file(f)
    assert anchor.load(f, here, None) is None
    assert int(here.down.seen) == 16
    assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), here.parameters()))


def test_a_state_over_the_budget_is_not_saved_and_every_world_says_why(tmp_path):
    """The reference writes every later step's state; past TPDIAG_ANCHOR_MAX_MB (llama-1b's float32
    state: ~15 GB a step) it writes none and says why (anchor/refused.txt), each TP > 1 world loads
    none, and world.json, summary.json and the ran line name it: its later steps are the drifted ones."""
    from conftest import run_cli

    d = tmp_path / "r"
    p = run_cli("compare", "--model", "py:tests/models/planted/int_buffer.py:seen_tokens", "--tp", "1,2",
                "--steps", "2", "--no-baseline", "--no-confirm", "--out", str(d),
                env={"OMP_NUM_THREADS": "1", "TPDIAG_ANCHOR_MAX_MB": "0"})
    assert p.returncode == 0, p.stderr[-3000:] + p.stdout[-2000:]
    assert not (d / "tp1" / "anchor" / "step1.safetensors").exists()
    got = json.loads((d / "tp2" / "world.json").read_text())["anchor"]
    assert got["steps"] == [] and got["refused_at"] == 1 and "TPDIAG_ANCHOR_MAX_MB=0" in got["refused"], got
    s = json.loads((d / "summary.json").read_text())
    assert s["anchor"] is True and "TPDIAG_ANCHOR_MAX_MB=0" in s["degrees"]["2"]["anchor_refused"]["why"]
    assert "TP=2 refused it from step 1" in p.stdout and "those steps from its own weights" in p.stdout, p.stdout
