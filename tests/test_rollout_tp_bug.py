"""A planted TP > 1 bug on the trainer's side (tests/models/buggy.py: layer 1's row-parallel
down-projection rescaled) against an engine that is the same model at TP=1: `tpdiag rollout --tp 1,2
--fix all` says the TP=2 configuration under the fixes is not TP=1's bits - something the fixes do not
remove - and names the `tpdiag compare` that locates it. Control: the built-in model without the bug
gives TP=1's bits at TP=2 under the fixes, and nothing is said."""
import json

import torch


def _engine(tmp_path, spec_model):
    """The engine: the model at TP=1 sampling 2 sequences of 4 tokens, logprobs of its own logits."""
    torch.manual_seed(1234)
    model = spec_model().eval()
    g = torch.Generator().manual_seed(5)
    rows = []
    with torch.no_grad():
        for _ in range(2):
            ids = torch.randint(0, model.cfg.vocab_size, (1, 5), generator=g)
            lps = []
            for _ in range(4):
                lsm = torch.log_softmax(model(ids)[0, -1].float(), -1)
                t = torch.multinomial(lsm.exp(), 1, generator=g)
                lps.append(float(lsm[t]))
                ids = torch.cat([ids, t[None]], 1)
            rows.append({"input_ids": ids[0].tolist(), "prompt_len": 5, "logprobs": lps})
    f = tmp_path / "engine.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(f)


def _rollout(path, model):
    from tpdiag.rollout.run import RolloutConfig, run_rollout

    return run_rollout(RolloutConfig(file=path, model=model, tp=(1, 2), micro_batch=(2,), modes=("prefill",),
                                     fixes=("all",)))


def test_planted_tp_bug_is_said_and_the_correct_model_is_not(tmp_path):
    from tpdiag.models.tiny_llama import build

    path = _engine(tmp_path, build)  # the buggy target's weights are tiny-llama's at the same seed
    s = _rollout(path, "py:tests/models/buggy.py:target")
    inv = s["tp_invariance"]["tp2-mb2-prefill-all"]
    assert inv["tp1"] == "tp1-mb2-prefill-all" and inv["same_bits"] is False and inv["max_abs"] > 1e-4
    said = [n for n in s["notes"] if n.startswith("tp2-mb2-prefill-all is not tp1-mb2-prefill-all's bits")]
    assert said and "tpdiag compare --model py:tests/models/buggy.py:target --tp 1,2" in said[0]
    s = _rollout(path, "tiny-llama")
    assert s["tp_invariance"]["tp2-mb2-prefill-all"]["same_bits"] is True
    assert not any("is not tp1" in n for n in s["notes"])
