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
