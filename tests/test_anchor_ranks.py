"""`--anchor` loads the reference's state on every rank of a TP world or on none (runner/anchor.agreed).

Rank 0 alone writes world.json's `anchor`, and the diff reads the steps it names with the reference's
weights at both sides (diff/anchored.py). Each rank once decided alone: a rank whose AdamW holds no state
for a parameter (its grad never reached that rank - tests/models/planted/rank0_bias.py's replica) refused,
rank 0 loaded, and world.json said `anchored` over a step rank 1 ran from its own drifted weights. A real
two-rank gloo world, tiny Linear layers (~3 s)."""
import os

import torch
import torch.distributed as dist

from conftest import gloo_world


def _model(stepped: bool):
    torch.manual_seed(1)
    m = torch.nn.Linear(4, 8, bias=False)
    opt = torch.optim.AdamW(m.parameters(), foreach=False)
    if stepped:
        m(torch.ones(2, 4)).sum().backward()
        opt.step()
    return m, opt


def _worker(rank, world, port, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from tpdiag.runner import anchor

    # rank 1: no grad reached its replica, so its AdamW made no state for it
    m, opt = _model(stepped=rank == 0)
    before = m.weight.detach().clone()
    why = anchor.load(os.environ["TPDIAG_TEST_ANCHOR_FILE"], m, opt)
    got = [None] * world
    dist.all_gather_object(got, {"why": why, "loaded": not torch.equal(m.weight, before)})
    if rank == 0:
        q.put(got)
    dist.barrier()
    dist.destroy_process_group()


def test_a_rank_that_refuses_keeps_every_rank_from_loading(tmp_path, monkeypatch):
    from tpdiag.runner import anchor

    ref, opt = _model(stepped=True)
    with torch.no_grad():
        ref.weight.add_(1.0)  # the reference's state: other weights than either rank's
    path = anchor.state_file(str(tmp_path), 1)
    anchor.save(path, ref, opt)
    monkeypatch.setenv("TPDIAG_TEST_ANCHOR_FILE", path)
    got = gloo_world(_worker, 2, timeout=120)
    assert not got[1]["loaded"] and "optimizer state of weight" in got[1]["why"], got
    # rank 0 could load alone; it does not, and says which rank refused and why (world.json's `refused`)
    assert not got[0]["loaded"], got
    assert got[0]["why"] and got[0]["why"].startswith("rank 1: the optimizer state of weight"), got


def _with_stat(value: float):
    m, opt = _model(stepped=True)
    m.register_buffer("stat", torch.full((3,), value))
    return m, opt


def _split_worker(rank, world, port, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from tpdiag.runner import anchor

    got = {}
    for case, value in (("split", float(rank)), ("same", 5.0)):
        m, opt = _with_stat(value)  # split: each rank's own statistic; same: replicas agree
        before = m.weight.detach().clone()
        why = anchor.load(os.environ["TPDIAG_TEST_ANCHOR_FILE"], m, opt)
        got[case] = {"why": why, "loaded": not torch.equal(m.weight, before), "stat": m.stat.tolist()}
    every = [None] * world
    dist.all_gather_object(every, got)
    if rank == 0:
        q.put(every)
    dist.barrier()
    dist.destroy_process_group()


def test_a_buffer_split_across_ranks_keeps_the_world_from_loading(tmp_path, monkeypatch):
    """A floating buffer whose copies differ across the world's ranks (a per-rank statistic) is what a
    later step's read of it shows (diff/replicas.py): the reference's value loaded on every rank erased
    that, and load_stats.py:read / balance_bias.py:local_load read unknown, not rank-inconsistent-replica.
    No rank loads then, each says why; where the copies agree every rank loads, the buffer too."""
    from tpdiag.runner import anchor

    ref, opt = _with_stat(9.0)
    with torch.no_grad():
        ref.weight.add_(1.0)
    path = anchor.state_file(str(tmp_path), 1)
    anchor.save(path, ref, opt)
    monkeypatch.setenv("TPDIAG_TEST_ANCHOR_FILE", path)
    every = gloo_world(_split_worker, 2, timeout=120)
    for rank, got in enumerate(every):
        assert not got["split"]["loaded"] and got["split"]["stat"] == [float(rank)] * 3, got
        assert "buffer stat differs across this world's ranks" in got["split"]["why"], got
        assert got["same"]["why"] is None and got["same"]["loaded"] and got["same"]["stat"] == [9.0] * 3, got


def test_the_ran_line_names_a_world_that_refused_the_anchor():
    """The ran line named `--anchor` as the config asked it; a world that refused it (world.json `anchor`
    refused: diff/analyse.py's anchor_refused) ran its later steps from its own weights, and says so."""
    from tpdiag.cli.render import ran

    summary = {"steps": 3, "backward": True, "anchor": True, "reference_label": "1",
               "degrees": {"1": {"status": "bitwise"},
                           "2": {"status": "divergent", "anchor_refused": {"step": 1, "why": "rank 1: parameter w"}}}}
    line = ran(summary)
    assert "TP=2 refused it from step 1 (rank 1: parameter w): those steps from its own weights" in line, line
    del summary["degrees"]["2"]["anchor_refused"]
    assert "refused" not in ran(summary)


def test_every_world_that_ran_its_later_steps_from_its_own_state_is_named():
    """The anchor is the default: a world asked for it whose world.json names no anchored step - a TP=1
    configuration (only a TP > 1 world loads: runner/anchor.loads) or one that refused - is named
    (records/anchor.not_anchored: summary.json's anchor_refused, the ran line); an anchored world, a
    --no-anchor run, forward only or one step is not."""
    from tpdiag.records.anchor import not_anchored

    cfg = {"degree": 1, "steps": 3, "backward": True, "anchor": True, "micro_batch": 2}
    got = not_anchored({"config": cfg})
    assert got and got["step"] == 1 and "TP=1" in got["why"], got
    assert not_anchored({"config": {**cfg, "degree": 2}, "anchor": {"steps": [1, 2]}}) is None
    refused = not_anchored({"config": {**cfg, "degree": 2}, "anchor": {"steps": [1], "refused": "rank 1: x",
                                                                        "refused_at": 2}})
    assert refused == {"step": 2, "why": "rank 1: x"}
    assert not_anchored({"config": {**cfg, "degree": 2}})["step"] == 1  # asked, no anchor record: not loaded
    for off in ({"anchor": False}, {"backward": False}, {"steps": 1}, {"mode": "decode"}):
        assert not_anchored({"config": {**cfg, **off}}) is None, off


def test_the_ran_line_under_no_anchor_and_forward_only():
    """--no-anchor: the later steps from each side's own weights, said; forward only (no update, nothing
    loaded): nothing said of an anchor, whatever summary.json's anchor."""
    from tpdiag.cli.render import ran

    base = {"steps": 3, "reference_label": "1", "degrees": {"1": {"status": "bitwise"}}}
    assert "later steps from each side's own weights (--no-anchor" in ran({**base, "backward": True, "anchor": False})
    assert "anchor" not in ran({**base, "backward": False, "anchor": False})
    assert "reference's state (--anchor, the default)" in ran({**base, "backward": True, "anchor": True})


def test_a_reference_at_tp2_saves_its_state_with_every_rank(tmp_path):
    """A reference at TP=2 holds DTensors: gathering its state whole (full_tensor) is a collective. Rank 0
    alone called it and the reference world hung until its timeout (inconclusive); every rank joins now
    and rank 0 writes the whole tensors, which TP=4 loads cut to its own shards (~20 s: 2 + 4 ranks)."""
    import json

    from safetensors.torch import load_file

    from conftest import run_cli

    d = tmp_path / "r"
    p = run_cli("compare", "--model", "py:tests/models/planted/moe_expert_calls.py:calls_ok", "--tp", "2,4",
                "--steps", "2", "--anchor", "--no-baseline", "--no-confirm", "--timeout", "90", "--out", str(d),
                env={"OMP_NUM_THREADS": "1"})
    assert p.returncode == 0 and "inconclusive" not in p.stdout, p.stdout[-2000:] + p.stderr[-2000:]
    assert json.loads((d / "tp4" / "world.json").read_text())["anchor"] == {"steps": [1]}
    saved = load_file(str(d / "tp2" / "anchor" / "step1.safetensors"))
    # whole (the plan's ColwiseParallel `up` holds [32, 32] a rank at TP=2), its moments too
    assert saved["params:up.weight"].shape == (64, 32) and saved["moments:up.weight:exp_avg"].shape == (64, 32)
    assert "each later step from the reference's state (--anchor, the default)" in p.stdout, p.stdout
    assert "refused" not in p.stdout
