"""User-written Llamas with mistakes an RL team hits along the axes where a trainer's logprobs
and a rollout engine's part: decode vs prefill, TP in decode, micro-batch size. Each has a
correct twin (the same code with the mistake fixed) that must read rounding or identical; the
three decode mistakes share one twin, `decode_ok` (one model with all three fixed).

- static_cache: a gpt-fast-style preallocated KV cache. The buggy one sizes it
  from the config's KV-head count, which is the rank's count only at TP=1; at TP=2 a rank's local
  heads fill the first slots and attention reads zeros for the rest. Wrong only in decode at
  TP > 1 (prefill takes no cache).
      tpdiag compare --model py:tests/models/planted/rl_axes.py:static_cache --tp 1,2 --mode prefill,decode --grid --forward-only
- window: sliding-window attention whose cached path (one query per call) keeps the
  last W + 1 keys where the prefill mask keeps W. Wrong only in decode.
      tpdiag compare --model py:tests/models/planted/rl_axes.py:window --mode prefill,decode --forward-only
- restart: attention that takes its RoPE positions from its own KV cache (HF-style,
  positions computed inside the layer); the buggy one numbers each call's tokens from 0, so every
  decode step rotates its query and key as position 0. Wrong only in decode.
      tpdiag compare --model py:tests/models/planted/rl_axes.py:restart --mode prefill,decode --forward-only
- dropout_on: functional dropout with training=True (meant self.training): each call draws its
  own mask, so decode and prefill compute different functions. Not a wrong result a float64 run
  can show, nor rounding: `unknown` at the draw, saying why (the gate never passes it).
      tpdiag compare --model py:tests/models/planted/rl_axes.py:dropout_on --mode prefill,decode --forward-only
- batch_center / token_center: a "centering" norm after the embedding whose mean was meant per
  token (dim -1) but is taken over the batch and positions (dims 0, 1): each row's result depends
  on the other rows of its call, so the logprobs move with the micro-batch size.
      tpdiag compare --model py:tests/models/planted/rl_axes.py:batch_center --micro-batch 4,1
  token_center has a GRPO-style loss (a mean over sequences of each sequence's token mean) over
  responses of different lengths, declared (loss_mean="sequence"): rounding across micro-batch
  sizes. seq_mean_as_token is the same model and loss left at the default loss_mean ("token"):
  each micro-batch weighted by its share of the tokens, so its loss moves with the micro-batch
  size - named at the loss, saying why.
      tpdiag compare --model py:tests/models/planted/rl_axes.py:seq_mean_as_token --micro-batch 4,1
"""
import torch
import torch.nn.functional as F
from torch import nn

import tpdiag
from tpdiag.models import tiny_llama
from tpdiag.models.plans import llama_plan

WINDOW = 3
CFG = dict(vocab_size=64, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=16)


def _cfg():
    return tiny_llama.LlamaConfig(**CFG)


class StaticLayerKV:
    """One layer's keys/values in buffers allocated at the first call, written in place."""

    def __init__(self, heads, max_len):
        self.heads, self.max_len, self.pos = heads, max_len, 0
        self.k = self.v = None

    @property
    def length(self):
        return self.pos

    def update(self, k, v):
        B, S, h, D = k.shape
        if self.k is None:
            heads = self.heads or h   # None: the heads this rank computes
            self.k, self.v = k.new_zeros(B, self.max_len, heads, D), v.new_zeros(B, self.max_len, heads, D)
        self.k[:, self.pos:self.pos + S, :h] = k
        self.v[:, self.pos:self.pos + S, :h] = v
        self.pos += S
        return self.k[:, :self.pos], self.v[:, :self.pos]


class StaticCache:
    def __init__(self, n_layers, heads, max_len):
        self.layers = [StaticLayerKV(heads, max_len) for _ in range(n_layers)]

    @property
    def length(self):
        return self.layers[0].pos


class WindowAttention(tiny_llama.Attention):
    """Sliding-window attention (WINDOW keys) that rotates by positions it counts itself, the
    cached ones first (HF-style: positions inside the layer)."""

    def __init__(self, cfg, keep, restart):
        super().__init__(cfg)
        self.keep = keep        # keys the cached one-query path keeps: WINDOW is right
        self.restart = restart  # number each call's tokens from 0: wrong
        cos, sin = tiny_llama.rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, x, cos, sin, kv=None):
        B, S, _ = x.shape
        start = 0 if (kv is None or kv.length == 0 or self.restart) else kv.length
        cos, sin = self.cos[start:start + S], self.sin[start:start + S]
        q = self.wq(x).view(B, S, -1, self.head_dim)
        k = self.wk(x).view(B, S, -1, self.head_dim)
        v = self.wv(x).view(B, S, -1, self.head_dim)
        q, k = tiny_llama.apply_rope(q, cos, sin), tiny_llama.apply_rope(k, cos, sin)
        if kv is not None:
            k, v = kv.update(k, v)
        rep = q.shape[2] // k.shape[2]
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        if S == 1 and k.shape[1] > 1:
            k, v = k[:, -self.keep:], v[:, -self.keep:]
            mask = None
        else:  # a whole (prompt) sequence: causal within the window
            i = torch.arange(S, device=x.device)[:, None] + (k.shape[1] - S)
            j = torch.arange(k.shape[1], device=x.device)[None, :]
            mask = (j <= i) & (j > i - WINDOW)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.wo(o.transpose(1, 2).reshape(B, S, -1))


class DecodeLlama(tiny_llama.TinyLlama):
    def __init__(self, cfg, cache_from_config=False, keep=WINDOW, restart=False):
        super().__init__(cfg)
        self.cache_from_config = cache_from_config
        for layer in self.layers:
            layer.attention = WindowAttention(cfg, keep, restart)
        self.reset_parameters()

    def new_kv_cache(self):
        heads = self.cfg.n_kv_heads if self.cache_from_config else None
        return StaticCache(len(self.layers), heads, self.cfg.max_seq_len)


class DropoutOn(DecodeLlama):
    """Embedding dropout written with the functional form and training=True where
    training=self.training was meant: on at inference too, so an engine's logprobs are random."""

    def forward(self, input_ids, cache=None):
        S = input_ids.shape[1]
        start = cache.length if cache is not None else 0
        cos, sin = self.rope_cos[start:start + S], self.rope_sin[start:start + S]
        h = F.dropout(self.tok_embeddings(input_ids), 0.1, training=True)
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, **({} if cache is None else {"kv": cache.layers[i]}))
        return self.output(self.norm(h))


class Center(nn.Module):
    """Subtract a mean and rescale - meant per token."""

    def __init__(self, dim, dims):
        super().__init__()
        self.dims = dims
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return (x - x.mean(dim=self.dims, keepdim=True)) * self.weight


class CenteredLlama(tiny_llama.TinyLlama):
    def __init__(self, cfg, dims):
        super().__init__(cfg)
        self.center = Center(cfg.dim, dims)

    def forward(self, input_ids, cache=None):
        S = input_ids.shape[1]
        cos, sin = self.rope_cos[:S], self.rope_sin[:S]
        h = self.center(self.tok_embeddings(input_ids))
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h))


def _target(model):
    return tpdiag.Target(model=model, plan=llama_plan(), vocab_size=model.cfg.vocab_size)


def static_cache():
    return _target(DecodeLlama(_cfg(), cache_from_config=True))


def window():
    return _target(DecodeLlama(_cfg(), keep=WINDOW + 1))


def restart():
    return _target(DecodeLlama(_cfg(), restart=True))


def dropout_on():
    return _target(DropoutOn(_cfg()))


def decode_ok():
    """The twin of the three decode mistakes: the same model with each of them fixed."""
    return _target(DecodeLlama(_cfg()))


PROMPTS = (1, 3, 2, 5)   # each sequence's prompt length: the responses differ in length


def _response_inputs(g):
    ids = torch.randint(0, CFG["vocab_size"], (len(PROMPTS), 8), generator=g)
    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
    for i, p in enumerate(PROMPTS):
        labels[i, :p] = -100
    return {"input_ids": ids, "labels": labels}


def _seq_mean_loss(logits, labels):
    """GRPO-style: each sequence's token mean, then the mean over sequences."""
    tok = F.cross_entropy(logits.flatten(0, -2), labels.flatten(), ignore_index=-100,
                          reduction="none").view(labels.shape)
    keep = (labels != -100).to(tok.dtype)
    return ((tok * keep).sum(1) / keep.sum(1)).mean()


def _centered(dims, loss_mean="sequence"):
    """With a GRPO-style loss declared as a mean over sequences: micro-batches weighted by their
    share of the sequences."""
    t = _target(CenteredLlama(_cfg(), dims=dims))
    t.inputs, t.loss, t.loss_mean = _response_inputs, _seq_mean_loss, loss_mean
    return t


def batch_center():
    return _centered((0, 1))


def token_center():
    return _centered(-1)


def seq_mean_as_token():
    """The same loss, left at the default loss_mean ("token"): each micro-batch weighted by its
    share of the tokens, which is not how a mean over sequences splits."""
    return _centered(-1, "token")


def bad_loss_mean():
    return _centered(-1, "mean")
