"""The `Target` contract for `py:` models (DESIGN.md): a full model, its TP plan, and how to feed it."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn


@dataclass
class Target:
    model: nn.Module
    # {fqn or fqn-with-wildcards: ParallelStyle, or a transformers style name as in a
    # from_pretrained model's `model.tp_plan` (models/hf_plan.named_styles)}
    plan: dict[str, Any]
    vocab_size: int
    inputs: Callable[[torch.Generator], Any] | None = None
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    # Plan variants a target may offer ({"stock": plan, "stable": plan}); `plan` is the default.
    variants: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Largest degree the model can be split into (heads, kv heads, vocab, ffn); None: unknown.
    divisors: dict[str, int] = field(default_factory=dict)
    # What `loss` is a mean over, so a micro-batched step weights each micro-batch's loss as the
    # whole batch's loss weights it: "token" (a mean over the batch's unmasked tokens: each
    # micro-batch by its share of the tokens), "sequence" (a mean over sequences, e.g. GRPO's
    # per-sequence token means averaged: by its share of the sequences), "sum" (no mean: each as
    # it is). A loss weighted the wrong way moves with the micro-batch size beyond rounding.
    loss_mean: str = "token"
    # True: `loss` adds, on purpose, a term that does not depend on the label (a z-loss, an entropy
    # bonus). -loss with one token labelled is then that token's logprob minus the term, and only
    # how it moves with the label is checked (rollout/label_free.py) - a normaliser off by a per-row
    # constant (a logsumexp over columns past vocab_size, a temperature in the logsumexp alone)
    # moves with no label either, and reads as that term. False: -loss must be the logprob itself.
    loss_label_free: bool = False
    # Meta-device build (opt-in: a FUNC with a `device` parameter is called with the meta
    # device): init(fqn, module) fills that module's own parameters and buffers on the run's
    # device, called children first with the RNG seeded from (seed, fqn). None: each module's
    # reset_parameters(). See tpdiag.models.meta_init.
    init: Callable[[str, nn.Module], None] | None = None
    # How tpdiag built the model (set by the runner's build, recorded in the world's timings):
    # {'init': 'sharded' | 'whole', 'init_full_peak_bytes': most bytes of full (unsharded)
    # tensors held at once, 'init_whole_bytes', 'init_reason': why the whole path}.
    build: dict[str, Any] = field(default_factory=dict)
