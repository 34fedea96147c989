"""TP under the fixes: every TP > 1 configuration under a fix against its TP=1 twin (docs/rl.md).

The fixes make a TP degree compute TP=1's bits, so a TP > 1 configuration under them that is not
its twin's bits is the trainer's TP path differing from TP=1 beyond the reorderings they remove.
"""
from __future__ import annotations

from tpdiag.base.configs import Config


def find(configurations: list[Config], seqs, trainer: dict) -> dict:
    """{TP > 1 configuration under a fix: {tp, tp1 (its TP=1 twin), same_bits, max_abs}}."""
    import torch

    from tpdiag.rollout.metrics import same_bits

    out = {}
    for c in configurations:
        lab = c.rollout_name()
        twin = Config(1, c.micro_batch, c.mode, c.fix, c.flags, c.attention, c.padding).rollout_name()
        if c.tp == 1 or c.fix == "none" or lab not in trainer or twin not in trainer:
            continue
        # where both are -inf (a token --sampling's filters removed on both sides) they agree
        gaps = [float(torch.where(x == y, 0.0, x.double() - y.double())[s.prompt_len - 1:].abs().max())
                for s, x, y in zip(seqs, trainer[lab], trainer[twin])]
        out[lab] = {"tp": c.tp, "tp1": twin, "same_bits": same_bits(seqs, trainer[lab], trainer[twin]),
                    "max_abs": max(gaps) if gaps else 0.0}
    return out


def notes(invariance: dict, model: str, dtype: str) -> list[str]:
    return [f"{lab} is not {v['tp1']}'s bits (max |diff| {v['max_abs']:.3g} nats between them): "
            "under the fixes a TP degree gives TP=1's bits, so TP > 1 computes something TP=1 "
            "does not - a sharding bug, or a reordering no fix covers. `tpdiag compare --model "
            f"{model} --tp 1,{v['tp']} --dtype {dtype}` names the module and says which"
            for lab, v in invariance.items() if not v["same_bits"]]
