"""Refuse, before any world starts, a batch the model or the machine cannot hold.

Two checks, each in one line with the numbers: a sequence longer than the model's positions
(RoPE tables, position embeddings) would fail inside the world after the model is built; a
batch whose activations, logits and records do not fit the memory of the GPU (free memory on
device 0) or the host (MemAvailable, or the cgroup's limit where smaller) would grow a rank until
the kernel's OOM killer ends it - on a shared host, maybe another user's process first.

The estimate is a lower bound of the reference world's peak (TP=1 holds the whole model; at
TP > 1 on one host the ranks together hold at least as much): the larger of the loss's backward
(weights, activations kept for backward, the logits and the float32 cross-entropy's three
[tokens, vocab] tensors) and the optimizer step (weights, grads, AdamW's two moments). A run it
lets through can still run out of memory; one it refuses cannot fit.
"""
from __future__ import annotations

import functools
import os

from tpdiag.errors import BadInput

GiB = 1 << 30
_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}


@functools.lru_cache(maxsize=8)
def _hf_dims(path: str) -> dict:
    from tpdiag.models.hf import _transformers

    _transformers()
    from transformers import AutoConfig

    try:
        c = AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except Exception:  # noqa: BLE001 - the world reports an unusable config in its own words
        return {}
    if hasattr(c, "get_text_config"):
        c = c.get_text_config()
    g = lambda *names: next((getattr(c, n) for n in names if isinstance(getattr(c, n, None), int)), None)  # noqa: E731
    return {"positions": g("max_position_embeddings", "n_positions", "max_seq_len"),
            "vocab": g("vocab_size"), "dim": g("hidden_size", "n_embd", "d_model"),
            "layers": g("num_hidden_layers", "n_layer"), "ffn": g("intermediate_size", "n_inner"),
            "heads": g("num_attention_heads", "n_head")}


@functools.lru_cache(maxsize=8)
def param_counts(spec) -> tuple[int, tuple[int, ...]] | None:
    """(parameters outside the decoder layers, each decoder layer's parameters) of the whole
    model (no --layers), counted on a build on the meta device - no memory, no init - so a
    70B-shaped config costs seconds (a built-in preset: from its config, which needs no build:
    LlamaConfig.param_counts); None where the model cannot be built that way."""
    import re
    from dataclasses import replace

    spec = replace(spec, layers=0)
    try:
        if spec.kind == "builtin":
            from tpdiag.models import tiny_llama

            return tiny_llama.LlamaConfig(**tiny_llama.PRESETS[spec.value]).param_counts()
        if spec.kind == "hf":
            from tpdiag.models.hf import meta_build

            built = meta_build(spec.value)
            if built is None:
                return None
            model = built[0]
        else:
            return None
    except Exception:  # noqa: BLE001 - the world reports an unbuildable model in its own words
        return None
    layer = re.compile(r"(?:^|\.)layers\.(\d+)\.")
    outside, per = 0, {}
    for name, p in model.named_parameters():
        m = layer.search(name)
        if m is None:
            outside += p.numel()
        else:
            per[int(m.group(1))] = per.get(int(m.group(1)), 0) + p.numel()
    return outside, tuple(per.get(i, 0) for i in range(max(per) + 1 if per else 0))


def model_dims(spec, variant: str = "stock") -> dict:
    """What is known of the model's size without building it: positions, vocab, dim, layers, ffn,
    heads, params (any may be None); `total_layers`: the whole model's, where --layers slices it
    (spec.layers), `layers` and `params` then the slice's."""
    if spec.kind == "builtin":
        from tpdiag.models.presets import PRESETS

        p = {"vocab_size": 512, "dim": 256, "n_layers": 2, "n_heads": 16, "ffn_dim": 512, "max_seq_len": 4096,
             **PRESETS[spec.value]}
        dims = {"positions": p["max_seq_len"], "vocab": p["vocab_size"], "dim": p["dim"], "layers": p["n_layers"],
                "ffn": p["ffn_dim"], "heads": p["n_heads"]}
    elif spec.kind == "hf":
        dims = dict(_hf_dims(spec.value))
    else:
        from tpdiag.models.precheck import _py_target

        t = _py_target(spec, variant)
        if t is None:
            return {}
        dims = {"vocab": t.vocab_size, "params": sum(p.numel() for p in t.model.parameters()),
                "default_loss": t.loss is None}
        shape = inputs_shape(t)
        if shape is not None:
            dims["inputs_shape"] = shape
        return dims
    return sliced(dims, spec)


def inputs_shape(target) -> tuple[int, int] | None:
    """(rows, positions) of the batch a py: Target's own `inputs` draws - the step runs on it, not on
    --batch-size x --seq-len (runner/batch.make_batch) - read from its token tensor as runner/batch.tokens_of
    finds it (the Tensor, a dict's 'input_ids' else its first tensor, a tuple's first); None without
    inputs, or where drawing them fails (the world says why) or gives no [rows, positions, ...] tensor."""
    if target.inputs is None:
        return None
    import torch

    try:
        # the world's own draw (make_batch: a generator seeded cfg.seed + 1): a batch's size is no
        # function of the seed in any Target seen, so the default seed's stands for all
        batch = target.inputs(torch.Generator().manual_seed(1))
    except Exception:  # noqa: BLE001 - user code: its error is the world's to report, in its words
        return None
    if isinstance(batch, torch.Tensor):
        cands = [batch]
    elif isinstance(batch, dict):
        cands = [batch["input_ids"]] if "input_ids" in batch else list(batch.values())
    elif isinstance(batch, (tuple, list)):
        cands = list(batch)
    else:
        return None
    ids = next((t for t in cands if isinstance(t, torch.Tensor)), None)
    if ids is None or ids.ndim < 2 or min(ids.shape[:2]) < 1:
        return None
    return int(ids.shape[0]), int(ids.shape[1])


def sliced(dims: dict, spec, layers: int | None = None) -> dict:
    """dims for the first `layers` (default spec.layers; 0: all) decoder layers, with the exact
    parameter count where the meta build gives one."""
    n = spec.layers if layers is None else layers
    dims = dict(dims, total_layers=dims.get("layers"))
    counts = param_counts(spec) if spec.kind in ("builtin", "hf") else None
    if n:
        dims["layers"] = n
    if counts is not None:
        outside, per = counts
        dims["params"] = outside + sum(per[:n] if n else per)
    return dims


def loss_bytes(logits: int, dtype: str, backward: bool, default_loss: bool = True) -> int:
    """The most bytes the step's loss holds at once over `logits` logits ([tokens, vocab]) of the
    model's dtype, the logits included. runner/losses.default_loss is a cross-entropy in float32 from
    16-bit logits (float32 and float64 as they are): forward, log_softmax's output beside the logits
    and the upcast it reads (bfloat16: 10 bytes a logit, float32: 8); backward, log_softmax's
    backward holds its saved output, the grad nll_loss gives it and the grad it makes, three floats
    a logit beside the logits (bfloat16: 14, float32: 16 - one float32 [8 x 4096, 128256] alone is
    16.8 GB). tests/test_preflight_loss.py measures them against torch's own allocations. Another
    loss (the user's, or a fix's that takes it over): the logits and, with backward, their grad."""
    e = _BYTES.get(dtype, 4)
    if not default_loss:
        return logits * e * (2 if backward else 1)
    f = max(e, 4)  # the loss's float (runner/losses.upcast)
    return logits * (e + 3 * f if backward else e + f + (f if e < 4 else 0))


def estimate_bytes(dims: dict, batch: int, seq: int, dtype: str, backward: bool,
                   default_loss: bool = True) -> int:
    """A lower bound of the reference world's peak memory (see the module docstring): the larger of
    two moments that surely come, each counting only what surely lives then. default_loss: the step's
    loss is runner/losses.default_loss (float32 cross-entropy over [tokens, vocab]); False (the
    user's own loss, or a fix that takes the loss over) counts the logits alone there."""
    e = _BYTES.get(dtype, 4)
    tokens = batch * seq
    vocab, dim, layers = dims.get("vocab") or 0, dims.get("dim") or 0, dims.get("layers") or 0
    ffn = dims.get("ffn") or 4 * dim
    params = dims.get("params")
    if params is None:
        params = vocab * dim * 2 + layers * (4 * dim * dim + 3 * dim * ffn)
    loss = loss_bytes(tokens * vocab, dtype, backward, default_loss and dims.get("default_loss", True))
    if not backward:
        return int(params * e + loss)  # grad off: nothing is kept for backward
    # At the loss's backward: the weights, the activations kept for backward (per layer the norm
    # output and q, k, v ~ 4 x dim, the MLP's three ffn-wide ones; no seq x seq attention matrix,
    # which a fused attention kernel never materialises) and the loss's (loss_bytes). Parameter
    # grads and AdamW's moments are not there yet at the first step (zero_grad sets grads to None;
    # AdamW makes its state at its first step).
    act = tokens * layers * (4 * dim + 3 * ffn) * e
    at_loss = params * e + act + loss
    # At the optimizer step: the weights, their grads and AdamW's two moments (the weights' dtype).
    # Records are left out: full capture spills them to disk past its host budget.
    at_step = params * 4 * e
    return int(max(at_loss, at_step))


def available_bytes(device: str) -> tuple[int | None, str]:
    """(bytes free, where) for the device the reference world runs on; None when unknown."""
    if device == "cuda":
        try:
            import torch

            free, _ = torch.cuda.mem_get_info(0)
            return int(free), f"free on {torch.cuda.get_device_name(0)}"
        except Exception:  # noqa: BLE001 - no GPU to ask: the world's own error says more
            return None, "GPU"
    from tpdiag.base.hostmem import mem_available

    avail = mem_available()
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                lim = f.read().strip()
            if lim.isdigit() and int(lim) < (avail or 1 << 62):
                avail = int(lim)
        except OSError:
            continue
    return avail, "available host memory"


def guess_device(device: str, degrees) -> str:
    """The device the run will use, without failing (resolve_device raises later with its own words)."""
    if device != "auto":
        return device
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) == "":
        return "cpu"
    try:
        import torch

        return "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= max(degrees) else "cpu"
    except Exception:  # noqa: BLE001
        return "cpu"
