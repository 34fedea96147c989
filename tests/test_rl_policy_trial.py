"""An RL team's trial: "the trainer's logprobs must match the rollout engine's - BUG or rounding?"

compare, on the team's own policy (tests/models/rl_policy.py: its own KV cache, TP plan and
vocab-parallel logprob): a decode path whose RoPE positions are one too far and a logsumexp taken
per vocab shard (its loss left per rank, or averaged over the ranks) are BUG (gate 4); the correct policy is rounding across TP, decode and micro-batch
(float32 and bf16).

rollout, against the engines the team runs:
- transformers' generate() (a tiny Llama saved in bf16, loaded with AutoModelForCausalLM):
  tp1-mb4-decode-none is its raw logprobs bit for bit (torch.equal per sequence); its
  output_scores at temperature 0.7 read as temperature-processed and are reproduced with
  --trainer-temperature 0.7; the logprobs of the next token (an off-by-one in the dump) were
  "no sign of processing" with advice to try attention and static-cache settings - now named a
  misaligned token (rollout/shifted.py), which no setting closes.
- the team's own decode loop over its policy: with the RoPE bug, tpdiag's decode reproduces the
  engine bit for bit and the what-to-do line called the prefill -> decode gap "rounding, harmless
  unless you need bitwise" - a bug called rounding. Now a float64 check (rollout/mode_gap.py)
  names it; the correct policy's gap still reads rounding.
"""
import json

import pytest
import torch

from conftest import run_cli

SPEC = "py:tests/models/rl_policy.py:"
TINY = ("--seq-len", "8", "--no-baseline", "--no-confirm")


def _compare(tmp_path_factory, name, *args):
    d = tmp_path_factory.mktemp(name) / "r"
    p = run_cli("compare", "--model", SPEC + name.split("-")[0], *TINY, *args, "--out", str(d),
                env={"OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, (name, p.stderr[-3000:] + p.stdout[-2000:])
    return json.loads((d / "summary.json").read_text()), p.stdout, run_cli("gate", str(d), "--allow",
                                                                           "rounding").returncode


@pytest.mark.parametrize("name, args, config, where", [
    ("rope_decode_off1", ("--tp", "1", "--mode", "prefill,decode", "--batch-size", "2", "--forward-only"),
     "1-decode", "ROPE_SLICE"),
    ("lse_per_rank", ("--tp", "1,2", "--batch-size", "2"), "2", "loss"),
    ("lse_per_rank_synced", ("--tp", "1,2", "--batch-size", "2"), "2", "loss"),
])
def test_the_teams_bugs_read_bug_and_gate_4(tmp_path_factory, name, args, config, where):
    s, out, gate = _compare(tmp_path_factory, name, *args)
    assert s["class"] == "bug" and out.startswith("verdict: divergent, BUG"), out
    entry = s["configurations"].get(config) or s["degrees"][config]
    assert entry["class"] == "bug", entry
    if where == "ROPE_SLICE":  # the line that reads the RoPE table at the offset position
        src = open("tests/models/rl_policy.py").read().splitlines()
        where = f"aten::slice (at tests/models/rl_policy.py:{1 + next(i for i, x in enumerate(src) if 'self.cos[start:' in x)}"
    assert where in out.splitlines()[0], out.splitlines()[0]
    assert gate == 4


@pytest.mark.parametrize("name, args", [
    ("policy-grid", ("--tp", "1,2", "--mode", "prefill,decode", "--grid", "--batch-size", "2", "--forward-only")),
    ("policy-mb", ("--tp", "1", "--micro-batch", "4,1", "--batch-size", "4")),
    ("policy_bf16-grid", ("--tp", "1,2", "--mode", "prefill,decode", "--grid", "--batch-size", "2",
                          "--dtype", "bfloat16", "--forward-only")),
])
def test_the_correct_policy_is_not_a_bug(tmp_path_factory, name, args):
    s, out, gate = _compare(tmp_path_factory, name, *args)
    assert s["class"] != "bug" and "BUG" not in out.splitlines()[0], out
    assert gate == 0, out


# -- rollout: transformers' generate() as the engine -------------------------------------------

def _engine(root):
    """A user's tiny Llama saved in bf16 and its generate() over 4 left-padded prompts: JSONL files
    of the raw logprobs, the processed ones at T=0.7, and a dump taking the next token's logprob."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    d = root / "model"
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
    m = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(4)
    m.generation_config.use_cache = True
    m.to(torch.bfloat16).save_pretrained(d)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 128, (n,), generator=g).tolist() for n in (5, 8, 6, 7)]
    P = max(map(len, prompts))
    ids = torch.tensor([[0] * (P - len(p)) + p for p in prompts])
    mask = (ids != 0).long()
    files = {}

    def dump(name, res, rows, shift=0):
        lp = torch.stack(rows, 1).float().log_softmax(-1)
        lines, engine = [], []
        for b in range(len(ids)):
            new = res.sequences[b, P:].tolist()
            end = next((j for j, t in enumerate(new) if t == 2), None)
            new = new if end is None else new[:end + 1]
            toks = [new[min(j + shift, len(new) - 1)] for j in range(len(new))]
            engine.append(torch.tensor([lp[b, j, t].item() for j, t in enumerate(toks)]))
            lines.append(json.dumps({"input_ids": prompts[b] + new, "prompt_len": len(prompts[b]),
                                     "logprobs": engine[-1].tolist()}))
        (root / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
        files[name] = (str(root / f"{name}.jsonl"), engine)

    torch.manual_seed(5)
    res = model.generate(ids, attention_mask=mask, do_sample=True, max_new_tokens=8, top_k=0,
                         output_logits=True, return_dict_in_generate=True)
    dump("raw", res, res.logits)
    dump("shifted", res, res.logits, shift=1)
    torch.manual_seed(5)
    res = model.generate(ids, attention_mask=mask, do_sample=True, max_new_tokens=8, top_k=0, temperature=0.7,
                         output_scores=True, return_dict_in_generate=True)
    dump("temp07", res, res.scores)
    return "hf:" + str(d), files


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return _engine(tmp_path_factory.mktemp("engine"))


def _rollout(path, model, on_logprobs=None, **kw):
    from tpdiag.rollout.run import RolloutConfig, run_rollout

    kw = {"dtype": "bfloat16", "micro_batch": (4,), "fixes": ("none",), **kw}
    return run_rollout(RolloutConfig(file=path, model=model, **kw), on_logprobs=on_logprobs)


def test_generate_raw_logprobs_are_decodes_bits(engine):
    model, files = engine
    path, eng = files["raw"]
    got = {}
    s = _rollout(path, model, on_logprobs=got.update)
    assert s["closest"]["reproduced"] and s["closest"]["configurations"] == ["tp1-mb4-decode-none"]
    from tpdiag.rollout.read import read_rollout

    for q, e, t in zip(read_rollout(path).sequences, eng, got["tp1-mb4-decode-none"]):
        assert torch.equal(t[q.prompt_len - 1:], e), (t, e)
    assert s.get("shifted") is None and s.get("mode_gap") is None  # the model's decode is its prefill's function


def test_a_sampler_temperature_the_trainer_lacks_is_named_and_reproduced_with_it(engine):
    model, files = engine
    path, _ = files["temp07"]
    s = _rollout(path, model, modes=("decode",))
    assert not s["closest"]["reproduced"] and s["processed"]["kind"] == "temperature"
    assert "0.7" in s["processed"]["explanation"] and s.get("shifted") is None  # not a misaligned token
    from tpdiag.runner.recipe import Recipe

    s = _rollout(path, model, modes=("decode",), recipe=Recipe(temperature=0.7))  # --trainer-temperature 0.7
    assert s["closest"]["reproduced"]


def test_the_next_tokens_logprob_is_named_a_misaligned_token(engine):
    model, files = engine
    s = _rollout(files["shifted"][0], model, modes=("prefill",))
    assert not s["closest"]["reproduced"]
    assert (s.get("shifted") or {}).get("shift") == [0, 1], s.get("shifted")
    assert s["what_to_do"]["line"].split("First ")[1].startswith("fix which token"), s["what_to_do"]["line"]
    assert not any(w["near_tie"] for w in s["worst_tokens"])  # a 10-nat gap is no noise to flip a tie


# -- rollout: the team's own decode loop as the engine -------------------------------------------

def _own_engine(name, path):
    """The team's sampler: its policy (as tpdiag builds it: seeded 1234), one prompt per call through
    its KV cache, each sampled token's float32 log-softmax (tests/own_sampler.py)."""
    from own_sampler import sample

    return sample("tests/models/rl_policy.py", name, path)


@pytest.mark.parametrize("name, bug", [("rope_decode_off1", True), ("policy", False)])
def test_own_decode_reproduced_and_its_gap_judged(tmp_path, name, bug):
    path = _own_engine(name, tmp_path / "rollout.jsonl")
    s = _rollout(path, SPEC + name, dtype="float32", micro_batch=(1,))
    assert s["closest"]["configurations"] == ["tp1-mb1-decode-none"] and s["closest"]["reproduced"]
    mode = [d for d in s["what_to_do"]["differs"] if d["axis"] == "mode"][0]["meaning"]
    if bug:
        assert "not rounding" in mode and "rounding, harmless" not in mode, mode  # it read "rounding, harmless"
        assert (s.get("mode_gap") or {}).get("max_abs", 0) > 1e-2, s.get("mode_gap")
        assert s["what_to_do"]["line"].startswith("first: the engine's decode and the trainer's prefill")
        assert any(n.startswith("prefill and decode are not the same function") for n in s["notes"])
    else:
        assert s.get("mode_gap") is None
        assert "rounding, harmless" in mode, mode


def test_the_policys_tp2_under_the_fixes_has_tp1s_bits(tmp_path):
    """The policy has its own Target.loss, and tpdiag's logprobs kept the stock vocab-parallel
    log-softmax under --fix all: TP=2 was 1 ulp off TP=1 and the TP note said "a sharding bug, or a
    reordering no fix covers" of a correct model. The fix's logprob function now runs whoever
    wrote the loss (runner/losses.step_functions)."""
    path = _own_engine("policy", tmp_path / "rollout.jsonl")
    s = _rollout(path, SPEC + "policy", dtype="float32", tp=(1, 2), micro_batch=(1,), modes=("prefill",),
                 fixes=("all",))
    inv = s["tp_invariance"]["tp2-mb1-prefill-all"]
    assert inv["same_bits"] and inv["max_abs"] == 0.0, inv
    assert not any("is not tp1-mb1-prefill-all's bits" in n for n in s["notes"]), s["notes"]
