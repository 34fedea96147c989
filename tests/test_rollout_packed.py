"""A trainer that packs its sequences (TRL's and verl's padding-free packing: a micro-batch's
sequences end to end in one row, position_ids restarting at 0 for each, no attention mask) against
tpdiag rollout's `--padding packed`.

- Qwen2 saved in bf16, one generate() batch: `tp1-mb8-prefill-none-padpacked` is the user's own
  packed forward (`model(ids, position_ids=pos, use_cache=False)`) bit for bit. The user's packed
  forward without `use_cache=False` attends across documents (transformers builds a cache and
  then ignores the restarts): far from it.
- LFM2 (short-convolution layers): its conv runs over the whole packed row, so a sequence's logprobs
  take in the sequences packed before it - the batch note names the packed configuration.
"""
import pytest
import torch

pytest.importorskip("transformers")

from tests.rl_team import engine, rollout, save_bf16  # noqa: E402


def _user_packed(model, rows, **kw):
    ids = torch.tensor([[t for x in rows for t in x["input_ids"]]])
    pos = torch.tensor([[p for x in rows for p in range(len(x["input_ids"]))]])
    with torch.no_grad():
        lsm = model(ids, position_ids=pos, **kw).logits[0].float().log_softmax(-1)
    out, at = [], 0
    for x in rows:
        n = len(x["input_ids"])
        out.append(lsm[at:at + n - 1].gather(-1, torch.tensor(x["input_ids"][1:])[:, None])[:, 0])
        at += n
    return out


def test_packed_prefill_is_the_users_packed_forward(tmp_path):
    path = save_bf16("qwen2", tmp_path / "q")
    files, model = engine(path, temperature=1.0)
    rows = files["raw"]
    s, got = rollout(tmp_path, rows, path, micro_batch=(8,), modes=("prefill",), padding=("auto", "packed"))
    mine = _user_packed(model, rows, use_cache=False)
    packed = got["tp1-mb8-prefill-none-padpacked"]
    assert all(torch.equal(a, b) for a, b in zip(mine, packed))
    # negative control: packing without use_cache=False lets every document see the ones before it
    # (whether the right-padded batch has other bits depends on the CPU's kernels: not asserted)
    leaky = _user_packed(model, rows)
    assert max((a - b).abs().max().item() for a, b in zip(leaky, packed)) > 0.1
    assert s["configurations"]["tp1-mb8-prefill-none-padpacked"]["status"] == "ok"
    assert s["batch_leak"] is None, s["batch_leak"]


def test_packed_prefill_of_a_conv_model_is_named_a_leak(tmp_path):
    path = save_bf16("lfm2", tmp_path / "l", layer_types=["conv", "full_attention"])
    files, _ = engine(path, temperature=1.0)
    s, _ = rollout(tmp_path, files["raw"], path, micro_batch=(8, 1), modes=("prefill", "decode"),
                   padding=("packed", "auto"))
    c = s["configurations"]
    assert "decode has no packed form" in c["tp1-mb8-decode-none-padpacked"]["reason"], c["tp1-mb8-decode-none-padpacked"]
    leak = s["batch_leak"]
    assert leak is not None and leak["configuration"] == "tp1-mb8-prefill-none-padpacked", leak
    assert leak["alone"] == "tp1-mb1-prefill-none-padpacked" and "packed before it" in leak["line"]
    assert leak["gap"] > 10 * leak["rounding"]
    # the packed trainer against generate(): what differs, and how to match it
    assert s["closest"]["configurations"] == ["tp1-mb8-decode-none"], s["closest"]
    assert ("padding packed -> auto: the engine padded on the left (generate()'s), your trainer packed its "
            "sequences into one row") in s["what_to_do"]["line"], s["what_to_do"]["line"]
