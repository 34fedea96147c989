"""generate() of a model that builds its own cache: transformers' MiniMax (linear-attention layers
beside full-attention ones) refuses the DynamicCache generate() gives other models
(`_supports_default_dynamic_cache()` is False: generate() passes no cache and the model's forward
makes a MiniMaxCache). tpdiag's decode built a DynamicCache for every hf: model, so the rollout's
decode configurations failed ('MiniMax uses cache of its own and is not compatible with `cache` of
type DynamicCache') and only the prefill ran - 'not reproduced' for an engine that was tpdiag's
own decode. A tiny MiniMax saved in bf16, loaded with from_pretrained, one generate() call with an
RL team's sampling: its raw logprobs are tpdiag's decode at the engine's batch bit for bit.
"""
import pytest
import torch

from rl_team import SAMPLE, engine, rollout, save_bf16

pytest.importorskip("transformers", minversion="5")

MINIMAX = dict(num_local_experts=4, num_experts_per_tok=2, layer_types=["linear_attention", "full_attention"])


@pytest.fixture(scope="module")
def minimax(tmp_path_factory):
    path = save_bf16("minimax", tmp_path_factory.mktemp("mm") / "minimax", **MINIMAX)
    files, model = engine(path, **SAMPLE)
    return path, files, model


def test_minimax_generate_is_reproduced_by_decode_with_the_models_own_cache(tmp_path, monkeypatch, minimax):
    path, files, model = minimax
    assert not model._supports_default_dynamic_cache()  # the case: generate() gives it no cache
    rows = files["raw"]
    n = sum(len(x["logprobs"]) for x in rows)
    s, _ = rollout(tmp_path, rows, path, modes=("decode", "prefill"))
    m = s["configurations"]["tp1-mb8-decode-none"]
    assert m["status"] == "ok", m
    assert m["metrics"]["exact_tokens"] == m["metrics"]["tokens"] == n
    assert s["closest"]["reproduced"] is True and s["closest"]["configurations"] == ["tp1-mb8-decode-none"]
    # the comparison can fail: the prefill is not the engine's decode
    assert s["configurations"]["tp1-mb8-prefill-none"]["metrics"]["exact_tokens"] < n
    # negative control: a DynamicCache handed to it, as tpdiag did for every hf: model
    from transformers import DynamicCache

    from tpdiag.runner import decode

    monkeypatch.setattr(decode, "_new_cache", lambda model, config, static_len=None: DynamicCache(config=config))
    from tpdiag.errors import BadInput

    with pytest.raises(BadInput, match="tp1-mb8-decode-none: ValueError: MiniMax uses cache of its own"):
        rollout(tmp_path, rows, path, modes=("decode",))


def test_a_batch_that_moves_its_sequences_beyond_rounding_is_named(tmp_path, minimax):
    # transformers 5.24's MiniMax: a decode step after a left-padded prompt moves a sequence ~0.4
    # nats from the same sequence decoded alone (its prefill with the same padding does not). The
    # engine's generate() batch is tp1-mb8-decode-none bit for bit, and what-to-do called the
    # trainer's gap to it (token_mult_prob_error 1.066) 'rounding, harmless'
    path, files, _ = minimax
    s, _ = rollout(tmp_path, files["raw"], path, micro_batch=(8, 1), modes=("prefill", "decode"))
    assert s["closest"]["configurations"] == ["tp1-mb8-decode-none"]
    leak = s["batch_leak"]
    assert leak and leak["configuration"] == "tp1-mb8-decode-none" and leak["alone"] == "tp1-mb1-decode-none", leak
    assert leak["ratio"] > 10 and leak["max_abs"] > 0.1, leak
    assert any(n.startswith("tp1-mb8-decode-none is ") and "not a kernel's rounding" in n for n in s["notes"])
    assert s["what_to_do"]["line"].startswith("first: the engine's numbers are not the model's"), s["what_to_do"]


def test_batch_leak_reads_the_mean_gap_against_the_runs_own_rounding():
    from tpdiag.base.configs import Config
    from tpdiag.rollout import batch_leak
    from tpdiag.rollout.read import Sequence

    seqs = [Sequence(list(range(3, 13)), 4, [-1.0] * 6, where=f"line {i + 1}") for i in range(4)]
    base = torch.linspace(-3.0, -0.5, 9)

    def run(decode_batch_shift, rounding=True):
        t = {}
        for mb in (4, 1):
            for mode in ("prefill", "decode"):
                lp = [base.clone() for _ in seqs]
                if rounding:
                    lp[0][5] += 1e-3 * (mb == 1) + 2e-3 * (mode == "decode")   # rounding: one token, a little
                if mode == "decode" and mb == 4:
                    for x in lp[1:]:
                        x[3:] += decode_batch_shift                     # the padded sequences, every token
                t[Config(1, mb, mode).rollout_name()] = lp
        return batch_leak.find([Config(1, mb, mode) for mb in (4, 1) for mode in ("prefill", "decode")], seqs, t)

    leak = run(0.05)
    assert leak["configuration"] == "tp1-mb4-decode-none" and leak["mode"] == "decode" and leak["ratio"] > 10, leak
    # controls: a decode batch moved by rounding-sized amounts is not named, nor one with nothing to
    # measure rounding against (no micro-batch 1 prefill)
    assert run(1e-3) is None
    # kernels that give the same bits at every other call shape: nothing to take a ratio to, and the
    # leak is named all the same (main at 2d251fd returned None: 'no rounding to measure against')
    leak = run(0.05, rounding=False)
    assert leak["configuration"] == "tp1-mb4-decode-none" and leak["rounding"] == 0.0 and leak["ratio"] is None, leak
    assert "every other setting gives the same bits" in leak["line"], leak["line"]
    from tpdiag.rollout.todo import _times

    assert _times(leak) == "where every other setting is bitwise" and _times(run(0.05)).endswith("x rounding")
    assert run(5e-4, rounding=False) is None  # below the floor: not named
    cfgs = [Config(1, 4, "decode"), Config(1, 1, "decode")]
    t = {c.rollout_name(): [base.clone() + (0.05 if c.micro_batch == 4 else 0.0) for _ in seqs] for c in cfgs}
    assert batch_leak.find(cfgs, seqs, t) is None
