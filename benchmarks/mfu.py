"""Model FLOPs utilisation (MFU) of a training step.

Model FLOPs per training step (forward + backward = 3x the forward's 2 FLOPs per MAC):

    flops = 6 * N * tokens + 6 * layers * seq^2 * hidden * batch

N is the matmul parameter count (every linear layer and the LM head; not the embedding table,
whose lookup does no multiplies, nor the norms), tokens = batch * seq. The attention term is
the score (Q K^T) and value (P V) products: 2 products x 2 FLOPs x seq^2 x hidden per layer and
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
    """Matmul parameters, layers and hidden size of a built-in preset (None: not a preset)."""
    from tpdiag.models.tiny_llama import PRESETS

    p = PRESETS.get(model)
    if p is None:
        return None
    d, hd = p["dim"], p["dim"] // p["n_heads"]
    per_layer = d * d * 2 + 2 * d * p["n_kv_heads"] * hd + 3 * d * p["ffn_dim"]  # q, o, k+v, w1 w2 w3
    return {"matmul_params": p["n_layers"] * per_layer + d * p["vocab_size"],  # + LM head
            "layers": p["n_layers"], "hidden": d}


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
