"""Which SDPA backend actually ran, not only which were enabled (tpdiag.runner.flags.snapshot).

    with SdpaRan() as ran:
        model(ids)
    ran.counts  # {'flash (cpu)': 32} - calls per backend

While the block runs, `torch.nn.functional.scaled_dot_product_attention` is wrapped: each call
first asks `torch._fused_sdp_choice` - the function aten's own SDPA dispatch calls to pick its
backend, on the same arguments and under the same sdpa_kernel() restrictions - which backend
this call takes, then runs the call unchanged. Asking costs a few microseconds and no kernel,
so the numbers are untouched; it is exact where dispatch goes through that choice (CPU and
CUDA tensors). A call it cannot ask about (a DTensor, an older torch without the function) is
counted as 'unknown'. Code that bound the function before the block (`from torch.nn.functional
import scaled_dot_product_attention`) is not seen: transformers' and the built-in presets'
attention look it up at call time.
"""
from __future__ import annotations

# aten's SDPBackend enum (torch.nn.attention.SDPBackend); on the CPU FLASH_ATTENTION is aten's
# own CPU flash kernel (_scaled_dot_product_flash_attention_for_cpu), not the CUDA library
_NAMES = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn", 4: "overrideable"}


def backend_name(choice: int, device_type: str) -> str:
    name = _NAMES.get(int(choice), f"backend {int(choice)}")
    return f"{name} (cpu)" if device_type == "cpu" else name


class SdpaRan:
    """Counts, per backend name, the SDPA calls made inside the `with` block (nestable; one
    thread: it patches a module attribute)."""

    def __init__(self):
        self.counts: dict[str, int] = {}
        self._saved = None

    def __enter__(self):
        import torch.nn.functional as F

        self._saved = F.scaled_dot_product_attention
        inner = self._saved
        counts = self.counts

        def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kw):
            name = _choice(query, key, value, attn_mask, dropout_p, is_causal, scale, kw)
            counts[name] = counts.get(name, 0) + 1
            return inner(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                         scale=scale, **kw)

        F.scaled_dot_product_attention = sdpa
        return self

    def __exit__(self, *exc):
        import torch.nn.functional as F

        F.scaled_dot_product_attention = self._saved
        return False

    def summary(self) -> str:
        """'flash (cpu)' or 'flash 480, math 32' (calls) or 'none' (no SDPA call: eager attention)."""
        if not self.counts:
            return "none"
        if len(self.counts) == 1:
            return next(iter(self.counts))
        return ", ".join(f"{k} {v}" for k, v in sorted(self.counts.items(), key=lambda kv: -kv[1]))


def _choice(query, key, value, attn_mask, dropout_p, is_causal, scale, kw) -> str:
    import torch

    try:
        from torch.distributed.tensor import DTensor

        if any(isinstance(t, DTensor) for t in (query, key, value, attn_mask)):
            return "unknown"
        extra = {"enable_gqa": kw["enable_gqa"]} if "enable_gqa" in kw else {}
        c = torch._fused_sdp_choice(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, **extra)
    except Exception:  # noqa: BLE001 - informational: the call itself still runs as it would
        return "unknown"
    return backend_name(c, query.device.type)
