"""Built-in `tiny-llama`: a Llama-style causal LM small enough for TP=8 on a 2-core CPU.

Vocab-parallel embedding, RMSNorm, RoPE, grouped-query attention (kv heads < heads), SwiGLU,
untied LM head whose logits stay vocab-sharded for a vocab-parallel loss. Attention and MLP
read the head/ffn count from the local shard's shape, so the same code runs at every TP.

KV cache (decode, gpt-fast / torchtitan style): `model(tokens, cache=model.new_kv_cache())`
runs the tokens at positions cache.length.. and appends their keys and values to the cache, so
a prompt in one call and then one token per call gives the logits a single call over the whole
sequence gives (up to rounding: other GEMM and attention shapes - tpdiag.runner.decode).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tpdiag.models.presets import PRESETS  # noqa: F401  (kept importable from here)


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 512
    dim: int = 256
    n_layers: int = 2
    n_heads: int = 16
    n_kv_heads: int = 8
    ffn_dim: int = 512
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_seq_len: int = 4096
    # the depth the residual projections' init is scaled for (0: n_layers): a --layers slice
    # keeps the whole model's, so its layers hold the whole model's weights (models/slice.py)
    init_depth: int = 0

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def to_dict(self) -> dict:
        return asdict(self)

    def param_counts(self) -> tuple[int, tuple[int, ...]]:
        """(parameters outside the decoder layers, each layer's), as TinyLlama holds them (untied
        embedding and head, bias-free linears, RMSNorm weights): read from the config, as a build
        on the meta device would count them, without one - the meta device's Python kernels
        import torch._dynamo into the process (1.5-7 s of a 2-core host's CPU in compare's checks)."""
        q, kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        layer = 2 * self.dim + self.dim * (q + 2 * kv) + q * self.dim + 3 * self.dim * self.ffn_dim
        return 2 * self.vocab_size * self.dim + self.dim, (layer,) * self.n_layers

    def divisors(self) -> dict[str, int]:
        """Every dimension TP splits; a degree must divide all of them."""
        return {"n_heads": self.n_heads, "n_kv_heads": self.n_kv_heads,
                "vocab_size": self.vocab_size, "ffn_dim": self.ffn_dim}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return y.type_as(x) * self.weight


def rope_tables(head_dim: int, seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    ang = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv)
    return ang.cos().float(), ang.sin().float()


class LayerKV:
    """One layer's cached keys and values, [B, positions, local kv heads, head_dim] each: at TP > 1
    the rank's own heads (wk/wv are column-parallel, their outputs local shards), before the GQA
    repeat. Grows by concatenation, so attention always runs over exactly the positions seen."""

    def __init__(self):
        self.k = self.v = None

    def update(self, k, v):
        """Append the new positions' k/v; return every position's."""
        if self.k is not None:
            k, v = torch.cat([self.k, k], dim=1), torch.cat([self.v, v], dim=1)
        self.k, self.v = k, v
        return k, v


class KVCache:
    """The KV cache of one batch: a LayerKV per layer; `length` positions seen so far."""

    def __init__(self, n_layers: int):
        self.layers = [LayerKV() for _ in range(n_layers)]

    @property
    def length(self) -> int:
        k = self.layers[0].k
        return 0 if k is None else k.shape[1]


def apply_rope(x, cos, sin):
    # x: [B, S, H, D]; rotate interleaved pairs. float32 math so bf16 runs round once.
    xf = x.float().unflatten(-1, (-1, 2))
    a, b = xf[..., 0], xf[..., 1]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    out = torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2)
    return out.type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x, cos, sin, kv: LayerKV | None = None):
        B, S, _ = x.shape
        # Local head counts come from the shard's shape: the same code at every TP degree.
        q = self.wq(x).view(B, S, -1, self.head_dim)
        k = self.wk(x).view(B, S, -1, self.head_dim)
        v = self.wv(x).view(B, S, -1, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if kv is not None:
            k, v = kv.update(k, v)  # every position's keys/values, this call's last
        rep = q.shape[2] // k.shape[2]
        k = k.repeat_interleave(rep, dim=2)
        v = v.repeat_interleave(rep, dim=2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        o = F.scaled_dot_product_attention(q, k, v, **causal_args(S, k.shape[2], q.device))
        return self.wo(o.transpose(1, 2).reshape(B, S, -1))


def causal_args(queries: int, keys: int, device) -> dict:
    """SDPA's mask arguments for `queries` new positions after keys - queries cached ones: query i
    (position keys - queries + i) sees keys j <= that position. No cache: is_causal; one query:
    every key, no mask (what a decode step runs); a chunk after a cache: an explicit mask."""
    start = keys - queries
    if start == 0:
        return {"is_causal": True}
    if queries == 1:
        return {}
    pos = torch.arange(queries, device=device)[:, None] + start
    return {"attn_mask": torch.arange(keys, device=device)[None, :] <= pos}


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x, cos, sin, kv: LayerKV | None = None):
        # kv only with a cache: a call without one is what it always was (hooks see no kwargs)
        h = x + self.attention(self.attention_norm(x), cos, sin, **({} if kv is None else {"kv": kv}))
        return h + self.feed_forward(self.ffn_norm(h))


class TinyLlama(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self):
        # A CPU build (tiny_llama.build, py: targets): one seeded global stream in module order,
        # the same on every rank because every rank builds the whole model.
        for name, p in self.named_parameters():
            self.init_param(name, p)

    @torch.no_grad()
    def init_param(self, name: str, p: torch.Tensor) -> None:
        """The init rule of parameter `name` (its fqn in this model), drawn from the current RNG."""
        std = 0.02
        if name.endswith("norm.weight"):
            # Not exactly one, so a wrong norm-weight shard is visible.
            p.copy_(1.0 + 0.1 * torch.randn_like(p))
        else:
            nn.init.normal_(p, std=std if "wo" not in name and "w2" not in name
                            else std / math.sqrt(2 * (self.cfg.init_depth or self.cfg.n_layers)))

    @torch.no_grad()
    def init_module(self, fqn: str, module: nn.Module) -> None:
        """tpdiag.models.meta_init's per-module rule: the module's own parameters (the RNG is
        seeded from its fqn), and the rotary tables, recomputed, for the model itself."""
        for name, p in module.named_parameters(recurse=False):
            self.init_param(f"{fqn}.{name}" if fqn else name, p)
        if module is self:
            cos, sin = rope_tables(self.cfg.head_dim, self.cfg.max_seq_len, self.cfg.rope_theta)
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)

    def new_kv_cache(self) -> KVCache:
        """An empty cache for forward(..., cache=): tpdiag.runner.decode drives it."""
        return KVCache(len(self.layers))

    def forward(self, input_ids, cache: KVCache | None = None):
        """Logits of `input_ids` [B, S]. With a cache: the tokens are positions cache.length ..
        cache.length + S - 1 of sequences whose earlier positions are in the cache (appended to)."""
        S = input_ids.shape[1]
        start = cache.length if cache is not None else 0
        if start + S > self.rope_cos.shape[0]:
            raise ValueError(f"positions up to {start + S} exceed max_seq_len {self.rope_cos.shape[0]}")
        cos, sin = self.rope_cos[start:start + S], self.rope_sin[start:start + S]
        h = self.tok_embeddings(input_ids)
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, **({} if cache is None else {"kv": cache.layers[i]}))
        return self.output(self.norm(h))


def build(preset: str = "tiny-llama", **overrides) -> TinyLlama:
    """The whole model on the current default device, initialised from the global RNG."""
    kwargs = dict(PRESETS[preset])
    kwargs.update(overrides)
    return TinyLlama(LlamaConfig(**kwargs))


def build_on(device, seed: int, preset: str = "tiny-llama", **overrides) -> TinyLlama:
    """The whole model built on the meta device and initialised on `device` (float32), each
    module from an RNG seeded by (seed, its fqn): the same weights at every degree and rank."""
    from tpdiag.models.meta_init import materialize

    with torch.device("meta"):
        model = build(preset, **overrides)
    return materialize(model, device, seed, model.init_module)
