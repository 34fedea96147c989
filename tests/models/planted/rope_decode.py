"""A user's Llama whose one-token decode calls rotate queries and keys at the previous position
(an off-by-one in the decode path's RoPE offset). Prefill is the plain model; every decode step
is wrong by far more than rounding. The wrong slice of the RoPE table is taken in the model's
own forward (a view: no op there is recorded), and reaches layers.0 as an input.

    tpdiag compare --model py:tests/models/planted/rope_decode.py:target --mode prefill,decode --forward-only
"""
import tpdiag
from tpdiag.models import tiny_llama
from tpdiag.models.plans import llama_plan


class OffByOne(tiny_llama.TinyLlama):
    def forward(self, input_ids, cache=None):
        start = cache.length if cache is not None else 0
        S = input_ids.shape[1]
        at = start - 1 if (cache is not None and S == 1) else start
        cos, sin = self.rope_cos[at:at + S], self.rope_sin[at:at + S]
        h = self.tok_embeddings(input_ids)
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, **({} if cache is None else {"kv": cache.layers[i]}))
        return self.output(self.norm(h))


def target():
    cfg = tiny_llama.LlamaConfig(**{**tiny_llama.PRESETS["tiny-llama"], "n_layers": 1})
    return tpdiag.Target(model=OffByOne(cfg), plan=llama_plan(), vocab_size=cfg.vocab_size)


class Right(OffByOne):
    """The twin: every call rotates at its own positions."""

    def forward(self, input_ids, cache=None):
        start = cache.length if cache is not None else 0
        S = input_ids.shape[1]
        cos, sin = self.rope_cos[start:start + S], self.rope_sin[start:start + S]
        h = self.tok_embeddings(input_ids)
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, **({} if cache is None else {"kv": cache.layers[i]}))
        return self.output(self.norm(h))


def twin():
    cfg = tiny_llama.LlamaConfig(**{**tiny_llama.PRESETS["tiny-llama"], "n_layers": 1})
    return tpdiag.Target(model=Right(cfg), plan=llama_plan(), vocab_size=cfg.vocab_size)
