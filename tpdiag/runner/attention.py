"""The attention implementation a configuration runs (rollout's; compare's --attention axis takes
the SDPA ones): the model's own (`auto`: what `from_pretrained` picks - SDPA for most
transformers models), `eager` (transformers' matmul +
softmax attention), `sdpa`, or SDPA restricted to one backend (`sdpa-math`, `sdpa-flash`,
`sdpa-efficient`, `sdpa-cudnn`: torch.nn.attention.sdpa_kernel), or `flex` (transformers'
`flex_attention`: torch's flex_attention, compiled; rollout only). Engines and trainers differ here:
generate() runs the model's default, a trainer may run eager or flash attention.

For hf: models the implementation is switched with transformers' own `set_attn_implementation`
and put back afterwards. The built-in presets run SDPA (their only implementation): `eager` is
unavailable for them; a py: model's attention is its own code: only the SDPA backend restriction
applies to it (it reaches any F.scaled_dot_product_attention it calls).
"""
from __future__ import annotations

from contextlib import contextmanager

from tpdiag.base.configs import ATTENTIONS as CHOICES  # noqa: E402 - the configuration axis

# transformers' attn_implementation of a choice that is not SDPA's
IMPLEMENTATIONS = {"eager": "eager", "flex": "flex_attention"}
_BACKENDS = {"sdpa-math": "MATH", "sdpa-flash": "FLASH_ATTENTION", "sdpa-efficient": "EFFICIENT_ATTENTION",
             "sdpa-cudnn": "CUDNN_ATTENTION"}


def parse(text: str) -> tuple[str, ...]:
    from tpdiag.errors import BadInput

    out = tuple(p.strip().lower() for p in str(text).split(",") if p.strip())
    bad = [p for p in out if p not in CHOICES]
    if bad or not out:
        raise BadInput(f"--attention {text!r}: one or more, comma-separated; expected one of {', '.join(CHOICES)}")
    from tpdiag.base.points import no_repeat

    no_repeat("--attention", text, out)
    return out


def not_sdpa(choice: str, model_name: str, impl: str) -> str:
    """compare's refusal of an SDPA choice for a model whose own attention is not SDPA."""
    return (f"--attention {choice}: {model_name} runs {impl!r} attention, not SDPA: switching it builds "
            "its layers another attention mask than the reference's (other records); compare it with "
            "tpdiag rollout --attention instead")


@contextmanager
def attention(model, choice: str, unavailable=RuntimeError):
    """Run the block with `choice`'s attention; `unavailable(reason)` is raised where this model
    cannot run it."""
    from tpdiag.runner.decode import is_hf

    if choice == "auto":
        yield
        return
    impl = IMPLEMENTATIONS.get(choice, "sdpa")
    saved = None
    if is_hf(model):
        saved = model.config._attn_implementation
        if saved != impl:
            try:
                model.set_attn_implementation(impl)
            except Exception as e:  # noqa: BLE001 - transformers refuses it for this model
                raise unavailable(f"attention {choice}: transformers cannot set it for "
                                  f"{type(model).__name__}: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
            if model.config._attn_implementation != impl:
                raise unavailable(f"attention {choice}: {type(model).__name__} does not switch its "
                                  "attention implementation")
    elif impl != "sdpa":
        raise unavailable(f"attention {choice}: only hf: models switch their attention implementation "
                          "(the built-in presets run SDPA; a py: model runs its own code)")
    try:
        if choice in _BACKENDS:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            with sdpa_kernel([getattr(SDPBackend, _BACKENDS[choice])]):
                yield
        else:
            yield
    finally:
        if saved is not None and model.config._attn_implementation != saved:
            model.set_attn_implementation(saved)
