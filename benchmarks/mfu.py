"""Model FLOPs utilisation (MFU) of a training step.

Model FLOPs per training step (forward + backward = 3x the forward's 2 FLOPs per MAC):

    flops = 6 * N * tokens + 6 * layers * seq^2 * hidden * batch

N is the matmul parameter count (every linear layer and the LM head; not the embedding table,
whose lookup does no multiplies, nor the norms), tokens = batch * seq. For a mixture of experts
N counts the parameters a token runs through: the router and its top-k experts (plus any shared
expert), not every expert - the convention MoE papers report MFU in. The attention term is
the score (Q K^T) and value (P V) products: 2 products x 2 FLOPs x seq^2 x hidden per layer
(hidden here is heads x head_dim, the attention's width, which a config may set apart from d) and
sequence forward, x3 for training = 12 * layers * seq^2 * hidden * batch, halved for causal
attention (only the lower triangle is needed) = 6 * layers * seq^2 * hidden * batch. Recompute
and the optimizer are not model FLOPs.

MFU = flops / (step seconds * GPUs * peak). Under TP every rank runs the same batch on its
shard, so a TP=n step has n GPUs' peak to fill. Peak: dense bf16 tensor-core FLOP/s from the
GPU's name (H100 / H200 SXM: 989.4e12), else --peak-tflops; none known -> MFU not reported.
"""
from __future__ import annotations

PEAK_BF16 = {"H100": 989.4e12, "H200": 989.4e12}


def peak_flops(gpu_name: str | None, peak_tflops: float | None = None) -> float | None:
    """Dense bf16 peak FLOP/s of one device: --peak-tflops if given, else from the name."""
    if peak_tflops:
        return peak_tflops * 1e12
    for key, v in PEAK_BF16.items():
        if gpu_name and key in gpu_name:
            return v
    return None


def preset_dims(model: str) -> dict | None:
    """Matmul parameters, layers and attention width of a built-in preset or an `hf:DIR` decoder
    config (None: neither, or a config without the fields read here)."""
    from tpdiag.models.tiny_llama import PRESETS

    if model.startswith("hf:"):
        return hf_dims(model[3:])
    p = PRESETS.get(model)
    if p is None:
        return None
    d, hd = p["dim"], p["dim"] // p["n_heads"]
    per_layer = d * d * 2 + 2 * d * p["n_kv_heads"] * hd + 3 * d * p["ffn_dim"]  # q, o, k+v, w1 w2 w3
    return {"matmul_params": p["n_layers"] * per_layer + d * p["vocab_size"],  # + LM head
            "layers": p["n_layers"], "hidden": d}


def hf_dims(path: str) -> dict | None:
    """The same three numbers from a transformers decoder config.json (dense or MoE: active
    parameters per token)."""
    import json
    import os

    try:
        with open(os.path.join(path, "config.json")) as f:
            c = json.load(f)
        d, layers, heads = c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"]
    except (OSError, ValueError, KeyError):
        return None
    hd = c.get("head_dim") or d // heads
    kv = c.get("num_key_value_heads") or heads
    attn = 2 * d * heads * hd + 2 * d * kv * hd  # q, o, k + v
    experts = c.get("num_experts") or c.get("num_local_experts") or 0
    if experts:
        k = c.get("num_experts_per_tok") or 1
        ffn = k * 3 * d * (c.get("moe_intermediate_size") or c["intermediate_size"]) + d * experts
        ffn += 3 * d * (c.get("shared_expert_intermediate_size") or 0)
    else:
        ffn = 3 * d * c["intermediate_size"]
    return {"matmul_params": layers * (attn + ffn) + d * c["vocab_size"], "layers": layers,
            "hidden": heads * hd}


def step_flops(model: str, batch: int, seq: int) -> float | None:
    """Model FLOPs of one training step (see the module docstring), None if not a preset."""
    dims = preset_dims(model)
    if dims is None:
        return None
    return (6 * dims["matmul_params"] * batch * seq
            + 6 * dims["layers"] * seq * seq * dims["hidden"] * batch)


def mfu(flops: float | None, seconds: float, gpus: int, peak: float | None) -> float | None:
    if not flops or not peak or seconds <= 0:
        return None
    return flops / (seconds * gpus * peak)


def fmt(m: float | None) -> str:
    return "n/a" if m is None else f"{100 * m:.1f}%"
