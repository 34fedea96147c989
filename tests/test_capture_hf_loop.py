"""`tpdiag.capture` around an RL team's own transformers training step: a checkpoint loaded with
from_pretrained, their AdamW, their loss masking (prompt and left padding at -100) and labels as
transformers takes them (unshifted: the logits at t score labels[t + 1]), with and without
gradient checkpointing, then `tpdiag diff`.

Main at 0428e29: the diff of two such captures raised "malformed run directory (IndexError: The
shape of the mask [24] ... does not match ... [22])" - the label mask was applied to logprobs one
shorter per row; and a capture with `gradient_checkpointing_enable()` recorded every checkpointed
module's forward twice (the recompute inside the backward as call #1), so against the same step
without it the diff read `divergent, not judged` although every record was bitwise equal.
"""
import json
import os

import pytest

from conftest import gloo_world

pytest.importorskip("transformers")

MODES = ("plain", "checkpointing", "reentrant")


def _worker(rank, world, port, q):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    import tpdiag

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    base = os.environ["HF_LOOP_OUT"]
    for mode in MODES:
        tpdiag.set_deterministic(seed=0, cpu_threads=1)
        model = AutoModelForCausalLM.from_pretrained(os.path.join(base, "model"), dtype=torch.bfloat16)
        model.train()
        if mode == "checkpointing":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        elif mode == "reentrant":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(1)
        ids = torch.randint(3, 128, (2, 12), generator=g)
        mask = torch.ones_like(ids)
        mask[1, :4] = 0  # the second row left-padded
        labels = ids.clone()
        labels[:, :6] = -100  # the prompt is not trained on
        labels[mask == 0] = -100
        with tpdiag.capture(model, out=os.path.join(base, mode), seed=0) as cap:
            cap.batch(input_ids=ids, labels=labels)
            logits = model(ids, attention_mask=mask, use_cache=False).logits
            cap.logits(logits)
            shift, target = logits[:, :-1].float(), labels[:, 1:]
            with torch.no_grad():
                cap.logprobs(-F.cross_entropy(shift.flatten(0, -2), target.flatten(), ignore_index=-100,
                                              reduction="none"))
            loss = F.cross_entropy(shift.flatten(0, -2), target.flatten(), ignore_index=-100)
            cap.loss(loss)
            loss.backward()
            opt.step()
            opt.zero_grad()
            cap.params()
    dist.barrier()
    q.put("done")


@pytest.fixture(scope="module")
def captures(tmp_path_factory):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    base = tmp_path_factory.mktemp("hfloop")
    cfg = AutoConfig.for_model("qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                               max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).save_pretrained(base / "model")
    mp = pytest.MonkeyPatch()
    try:
        mp.setenv("HF_LOOP_OUT", str(base))
        mp.setenv("OMP_NUM_THREADS", "1")
        assert gloo_world(_worker, 1, timeout=240) == "done"
    finally:
        mp.undo()
    return base


@pytest.mark.parametrize("mode", MODES[1:])
def test_a_users_hf_step_with_checkpointing_diffs_bitwise(captures, tmp_path, mode):
    from tpdiag.diff.runs import diff_runs
    from tpdiag.records.store import RecordSet

    s = diff_runs(str(captures / "plain"), str(captures / mode), str(tmp_path / "d"))
    d = s["degrees"]["1-2"]
    assert s["status"] == "bitwise" and d["unmatched"] == [] and d["missing"] == [], json.dumps(d)[:2000]
    # the logprobs the step scored: labels[:, 1:] that are not -100 (transformers' shift)
    rs = RecordSet(str(captures / "plain"))
    labels = rs.tensor(next(m for m in rs.events if m["key"] == "s0/init/model/batch#0/labels"))
    assert d["logprobs"]["tokens"] == int((labels[:, 1:] != -100).sum()) == 12
    assert d["logprobs"]["bitwise"] is True
    # every checkpointed module was recorded once per step, and its grads are there (the
    # reentrant recompute is where the backward runs through them)
    def keys(m):
        return [json.loads(x)["key"] for x in (captures / m / "events.jsonl").read_text().splitlines()]

    assert sorted(keys(mode)) == sorted(keys("plain"))
    assert "s0/backward/model.layers.1.mlp.down_proj/grad_out#0/0" in keys(mode)
