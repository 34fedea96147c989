"""`tpdiag rollout --jobs N` starts its lanes before this process builds its model
(tpdiag.rollout.early): the rank environment a launch puts into this process is gone before this
process builds or computes anything, and bad input found by the build ends the lanes at once.
The lanes' bits are test_rollout_lanes.py's (that path runs through here)."""
import json
import multiprocessing as mp
import os

import pytest

from tpdiag.errors import BadInput

CUBLAS = "CUBLAS_WORKSPACE_CONFIG"


def _rollout_file(tmp_path) -> str:
    path = tmp_path / "rollout.jsonl"
    with open(path, "w") as f:
        for i in range(4):
            f.write(json.dumps({"input_ids": [1 + i, 2, 3, 4, 5, 6], "prompt_len": 3,
                                "logprobs": [-1.0, -1.5, -2.0]}) + "\n")
    return str(path)


def test_bad_input_from_the_build_cancels_the_started_lanes_and_the_environment_is_put_back(tmp_path,
                                                                                           monkeypatch):
    from tpdiag.rollout import compute, lanes
    from tpdiag.rollout.run import RolloutConfig, run_rollout

    monkeypatch.delenv(CUBLAS, raising=False)
    monkeypatch.setenv("TPDIAG_PRESTART", "0")  # no fork server: no world starts here
    seen = {}

    def fake_lanes(rc, seqs, cfgs, counts, work, groups, threads, on_status=None, cancel=None, launches=None):
        # what a launch does to this process (tpdiag.runner.start_context._context), then a lane that runs
        # until it is cancelled
        os.environ[CUBLAS] = ":4096:8"
        seen["set_by_launch"] = os.environ.get(CUBLAS)
        seen["labels"] = [c.rollout_name() for c in cfgs]
        launches.expect(1)
        launches.one()
        seen["cancelled"] = cancel.wait(60)
        return {}

    def failing_build(*a, **k):
        seen["at_build"] = os.environ.get(CUBLAS, "unset")
        raise BadInput("the model does not load")

    monkeypatch.setattr(lanes, "run", fake_lanes)
    monkeypatch.setattr(compute, "build", failing_build)
    with pytest.raises(BadInput, match="does not load"):
        run_rollout(RolloutConfig(file=_rollout_file(tmp_path), model="tiny-llama", micro_batch=(4, 1),
                                  modes=("prefill",), fixes=("none",), jobs=2))
    assert seen["set_by_launch"] == ":4096:8"       # the control: a launch did leak it here
    assert seen["at_build"] == "unset"              # ... and it was gone before the build
    assert seen["cancelled"] is True                # the lane was ended, not waited for
    assert os.environ.get(CUBLAS) is None
    # the first TP=1 configuration is this process's (the margins' collector), the rest the lanes'
    assert seen["labels"] == ["tp1-mb1-prefill-none"]


def test_a_cancelled_world_ends_at_once_and_its_ranks_are_killed(tmp_path):
    import threading

    from tpdiag.config import WorldConfig
    from tpdiag.rollout import world
    from tpdiag.rollout.compute import Config
    from tpdiag.rollout.read import read_rollout
    from tpdiag.runner.launch import run_world

    seqs = read_rollout(_rollout_file(tmp_path)).sequences
    out = str(tmp_path / "tp1")
    os.makedirs(out)
    world.write_inputs(out, seqs, [Config(1, 1, "decode", "none")])
    cfg = WorldConfig.of(model="tiny-llama", degree=1, label="1", out_dir=out, dtype="float32", device="cpu",
                         backward=False, seed=1, probes=False, selfcheck=False, flags="default")
    cancel = threading.Event()
    # cancelled as the ranks start: none can have built a model and written its result by the
    # launcher's first look
    res = run_world(cfg, 120.0, on_status=lambda label, state: cancel.set() if state == "running" else None,
                    entry=world.main, cancel=cancel)
    assert res.status == "failed" and res.error == "cancelled"
    assert not os.path.exists(os.path.join(out, world.RESULTS))
    assert not [p for p in mp.active_children() if p.name.startswith("tpdiag-tp1-rank")]
