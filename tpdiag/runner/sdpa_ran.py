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
counted as 'unknown'; one the invariant-attention fix takes over (tpdiag.fixes.attention) as
'tpdiag invariant attention'. Code that bound the function before the block (`from torch.nn.functional
import scaled_dot_product_attention`) is not seen: transformers' and the built-in presets'
attention look it up at call time.
"""
from __future__ import annotations

# aten's SDPBackend enum (torch.nn.attention.SDPBackend); on the CPU FLASH_ATTENTION is aten's
# own CPU flash kernel (_scaled_dot_product_flash_attention_for_cpu), not the CUDA library
_NAMES = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn", 4: "overrideable"}


def in_words(by_config: dict) -> str:
    """{configuration: {backend: calls}} in one line: the backends and, where they differ between
    configurations, which configurations took each ('flash (cpu) in every configuration';
    'math in tp1-eager; flash in tp1')."""
    groups: dict[str, list] = {}
    for lab, counts in by_config.items():
        names = ", ".join(sorted((counts or {}).keys())) or "none (no SDPA call)"
        groups.setdefault(names, []).append(lab)
    if len(groups) <= 1:
        return "".join(f"{k} in every configuration" for k in groups)
    return "; ".join(f"{k} in {', '.join(labs)}" for k, labs in groups.items())


def backend_name(choice: int, device_type: str) -> str:
    name = _NAMES.get(int(choice), f"backend {int(choice)}")
    return f"{name} (cpu)" if device_type == "cpu" else name


class SdpaRan:
    """Counts, per backend name, the SDPA calls made inside the `with` block (nestable; one
    thread: it patches a module attribute)."""

    def __init__(self, pause=None):
        """pause: a context manager factory under which the backend is asked - compare's recorder
        paused, so an op probe does not record the question (aten::_fused_sdp_choice) as an op."""
        self.counts: dict[str, int] = {}
        self._saved = None
        self._pause = pause

    def __enter__(self):
        import torch.nn.functional as F

        # the invariant-attention fix recognises SDPA calls by identity with the function it
        # bound at import: imported first under this wrapper, it would bind the wrapper and
        # never take a call (stock attention under --fix all: other bits)
        import tpdiag.fixes.attention  # noqa: F401

        from torch.compiler import is_compiling

        self._saved = F.scaled_dot_product_attention
        inner = self._saved
        counts = self.counts
        pause = self._pause

        def sdpa(*args, **kwargs):
            if is_compiling():
                # traced by dynamo (rollout --padding compiled: generate()'s compiled decode): the
                # question and the count would break the user's graph into pieces - other fusions,
                # other bits (an H200: none of a compiled engine's sequences matched with them). The
                # call is the user's own there; its backend is inductor's choice, not counted
                return inner(*args, **kwargs)
            # the call goes on exactly as made: an argument spelled out where the caller left it
            # to its default can take another path in a function mode (the invariant fix's)
            if pause is None:
                name = _choice(args, kwargs)
            else:
                with pause():
                    name = _choice(args, kwargs)
            counts[name] = counts.get(name, 0) + 1
            return inner(*args, **kwargs)

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


_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")


def _choice(args, kwargs) -> str:
    import torch

    if _invariant_on():  # its TorchFunctionMode takes the call: aten's SDPA never runs
        return "tpdiag invariant attention"
    try:
        from torch.distributed.tensor import DTensor

        a = {**dict(zip(_ARGS, args)), **kwargs}
        q, k, v, mask = a["query"], a["key"], a["value"], a.get("attn_mask")
        if any(isinstance(t, DTensor) for t in (q, k, v, mask)):
            return "unknown"
        extra = {n: a[n] for n in ("scale", "enable_gqa") if n in a}
        c = torch._fused_sdp_choice(q, k, v, mask, a.get("dropout_p", 0.0), a.get("is_causal", False), **extra)
    except Exception:  # noqa: BLE001 - informational: the call itself still runs as it would
        return "unknown"
    return backend_name(c, q.device.type)


def _invariant_on() -> bool:
    import sys

    fix = sys.modules.get("tpdiag.fixes.attention")
    if fix is None:
        return False
    from torch.overrides import _get_current_function_mode_stack

    return any(isinstance(m, fix.InvariantSDPAMode) for m in _get_current_function_mode_stack())
