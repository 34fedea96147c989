"""How `tpdiag rollout --jobs` plans its lanes (tpdiag.rollout.lanes): how many worlds each TP degree
gets, and on which GPUs they run. No world starts here: the plan is arithmetic on the
configurations' forward calls (the bits of each unit are test_rollout_lanes.py's)."""
from dataclasses import replace

from tpdiag.rollout.compute import Config
from tpdiag.rollout.lanes import lanes_per_degree, placement, share, weight
from tpdiag.rollout.read import Sequence
from tpdiag.rollout.run import RolloutConfig, configurations

# issue 56's grid at its shape: 4 sequences of 64 + 128 tokens, TP=1,2 x micro-batch 4,1 x
# prefill,decode x fix none,all
SEQS = [Sequence(list(range(192)), 64, [0.0] * 128) for _ in range(4)]
RC = RolloutConfig(file="x", model="hf:/nonexistent", tp=(1, 2), micro_batch=(4, 1), fixes=("none", "all"),
                   device="cuda", jobs=0)


def test_share_gives_every_degree_a_lane_then_the_most_work_per_lane_more():
    assert share({1: 1.0, 2: 1.7}, {1: 20, 2: 20}, 10) == {1: 2, 2: 4}   # 2 + 2 x 4 = 10 processes
    assert share({1: 1.0, 2: 1.7}, {1: 20, 2: 20}, 3) == {1: 1, 2: 1}
    assert share({1: 1.0, 2: 1.7}, {1: 20, 2: 20}, 2) == {1: 1, 2: 1}   # one each, whatever the budget
    assert share({1: 1.0}, {1: 3}, 10) == {1: 3}                          # no more lanes than units


def test_explicit_jobs_and_the_cpu_keep_their_meaning():
    cfgs = configurations(RC)
    assert lanes_per_degree(replace(RC, jobs=3), cfgs, SEQS) == {1: 3, 2: 3}
    assert lanes_per_degree(replace(RC, device="cpu"), cfgs, SEQS) == {1: 1, 2: 1}


def test_auto_on_cuda_gives_tp2_lanes_too(monkeypatch):
    """The 2-H200 run (1012b3a): TP=2 kept one world and ran 96 s of the rollout's 116 s. Auto now
    shares the processes the GPUs take between the degrees by their work."""
    from tpdiag.rollout import lanes

    monkeypatch.setattr(lanes, "auto_budget", lambda rc: (2, 5))
    got = lanes_per_degree(RC, configurations(RC), SEQS)
    assert got[2] > 1 and got[1] >= 1 and got[1] + 2 * got[2] <= 10
    monkeypatch.setattr(lanes, "auto_budget", lambda rc: (1, 5))  # one GPU, TP=1 only: 5 lanes
    assert lanes_per_degree(replace(RC, tp=(1,)), configurations(replace(RC, tp=(1,))), SEQS) == {1: 5}


def test_costs_rank_fixes_and_cudnn_graph_set_up_above_a_stock_call():
    from tpdiag.rollout.lanes import cost, unit_cost

    stock = Config(1, 1, "decode", "none")
    assert weight(Config(1, 1, "decode", "all")) > weight(stock)
    calls = cost(stock, SEQS, 0, 2)
    assert calls == 2 * 128 and unit_cost(stock, SEQS, 0, 2, "cpu") == calls
    # on CUDA under PyTorch's flags each new decode shape builds a cuDNN graph, once per lane
    assert unit_cost(stock, SEQS, 0, 2, "cuda") > unit_cost(stock, SEQS, 0, 1, "cuda") > calls / 2 + 64
    assert unit_cost(replace(stock, flags="deterministic"), SEQS, 0, 2, "cuda") == calls


def test_placement_spreads_lanes_over_the_gpus():
    assert [placement(1, k, 2) for k in range(4)] == [0, 1, 0, 1]
    assert [placement(2, k, 4) for k in range(3)] == [0, 2, 0]   # a TP=2 lane's ranks on (0,1), (2,3)
    assert [placement(2, k, 2) for k in range(3)] == [0, 0, 0]
    assert [placement(1, k, 1) for k in range(3)] == [0, 0, 0]   # one GPU (or the CPU): all there
    assert [placement(2, k, 3) for k in range(3)] == [0, 0, 1]   # never past the last GPU: (0,1), (0,1), (1,2)
