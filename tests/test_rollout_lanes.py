"""`tpdiag rollout --jobs N` (tpdiag.rollout.lanes) computes every configuration's logprobs bit for
bit as one process does (--jobs 1: TP=1 here, one world per other degree), on a rollout written by
transformers' own generate() (left-padded prompts of different lengths, KV cache, bf16); and the
SDPA backend that ran is recorded per configuration."""
import importlib.util
import os

import pytest
import torch

pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("tpdiag_example_hf_rollout_lanes",
                                               os.path.join(ROOT, "examples", "hf_rollout.py"))
engine = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(engine)

LENS = (5, 8, 6, 7)
NEW = 6


@pytest.fixture(scope="module")
def rollout_file(tmp_path_factory):
    d = tmp_path_factory.mktemp("lanes")
    model = engine.write_model(str(d / "model"), rope_theta=500000.0)
    seqs = engine.generate_batch(model, "bfloat16", LENS, NEW)
    path = str(d / "rollout.jsonl")
    with open(path, "w") as f:
        f.write(engine.as_jsonl(seqs))
    return path, model


def _run(path, model, **kw):
    from tpdiag.rollout.run import RolloutConfig, run_rollout

    got = {}
    s = run_rollout(RolloutConfig(file=path, model="hf:" + model, dtype="bfloat16", micro_batch=(4, 1),
                                  modes=("prefill", "decode"), fixes=("none",), **kw), on_logprobs=got.update)
    return s, got


def _same(x, y) -> bool:
    """Raw float32 bits equal, NaN where NaN (decode's prompt rows, which nothing compares:
    torch.equal calls NaN unequal to itself)."""
    nan = torch.isnan(x)
    return torch.equal(nan, torch.isnan(y)) and torch.equal(x[~nan].view(torch.int32), y[~nan].view(torch.int32))


def _differ(a: dict, b: dict) -> list:
    assert set(a) == set(b)
    return [lab for lab in a if len(a[lab]) != len(b[lab]) or not all(_same(x, y) for x, y in zip(a[lab], b[lab]))]


def test_lanes_give_one_process_bits_tp1_and_tp2(rollout_file):
    path, model = rollout_file
    one, lp1 = _run(path, model, tp=(1, 2), jobs=1)
    lanes, lp2 = _run(path, model, tp=(1, 2), jobs=2)
    assert len(lp1) == 8 and all(r["status"] == "ok" for r in one["configurations"].values())
    assert _differ(lp1, lp2) == []
    for lab, r in one["configurations"].items():
        assert lanes["configurations"][lab]["metrics"] == r["metrics"]
        assert lanes["configurations"][lab]["same_bits_as"] == r["same_bits_as"]
        # the backend that ran, from aten's own choice function: CPU SDPA in every configuration
        assert r["sdpa_ran"] and set(r["sdpa_ran"]) <= {"flash (cpu)", "math (cpu)"}
        assert lanes["configurations"][lab]["sdpa_ran"] == r["sdpa_ran"]
    assert lanes["worst_tokens"] == one["worst_tokens"] and lanes["processed"] == one["processed"]
    assert lanes["closest"] == one["closest"]
    assert "in every configuration" in one["sdpa_ran"]


def test_negative_control_the_comparison_sees_one_ulp(rollout_file):
    """The comparison above can fail: one float32 ulp moved in one token of one configuration
    (what any other kernel, shape or flag gives) is seen. (Cutting a micro-batch of 4 into single
    sequences - what `split` never does - happens to give the same bits on the CPU at this size,
    so it cannot serve as the control here.)"""
    path, model = rollout_file
    _, lp = _run(path, model, tp=(1,), jobs=2)
    moved = {lab: [t.clone() for t in v] for lab, v in lp.items()}
    t = moved["tp1-mb4-decode-none"][2]
    j = int((~torch.isnan(t)).nonzero()[-1])
    t[j] = torch.nextafter(t[j], torch.tensor(0.0))
    assert _differ(lp, moved) == ["tp1-mb4-decode-none"]


def test_split_keeps_micro_batches_whole():
    from tpdiag.rollout.compute import Config
    from tpdiag.rollout.lanes import assign, cost, split
    from tpdiag.rollout.read import Sequence

    seqs = [Sequence(list(range(10 + i)), 4, [0.0] * (6 + i)) for i in range(6)]
    c1, c2 = Config(1, 2, "decode", "none"), Config(1, 4, "prefill", "none")
    units = split([c1, c2], seqs, 3)
    for c, lo, hi in units:
        assert lo % c.micro_batch == 0 and (hi == len(seqs) or hi % c.micro_batch == 0)
    assert [(lo, hi) for c, lo, hi in units if c == c1] == [(0, 2), (2, 4), (4, 6)]
    assert [(lo, hi) for c, lo, hi in units if c == c2] == [(0, 4), (4, 6)]
    lanes = assign([(*u, cost(*u[:1], seqs, *u[1:])) for u in units], 3)
    assert sorted((u[0].rollout_name(), u[1], u[2]) for lane in lanes for u in lane) == sorted((c.rollout_name(), a, b) for c, a, b in units)


@pytest.mark.parametrize("bad", ["0", "-1", "two"])
def test_bad_jobs_is_one_line_exit_2(rollout_file, bad):
    from tests.conftest import run_cli

    path, model = rollout_file
    r = run_cli("rollout", path, "--model", "hf:" + model, "--device", "cpu", "--jobs", bad)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "--jobs" in lines[0] and "Traceback" not in r.stderr
