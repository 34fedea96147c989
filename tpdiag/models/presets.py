"""The built-in model presets {name: LlamaConfig kwargs}: plain data, so the CLI can list
them in its help without importing torch."""
from __future__ import annotations

# gpt-fast style presets: {name: kwargs}
PRESETS: dict[str, dict] = {
    # head_dim 16 keeps every column shard >= 16 wide at TP=8: on x86 CPU BLAS an 8-column
    # GEMM takes another kernel path and is not bitwise equal to a column slice of the full one.
    "tiny-llama": dict(vocab_size=512, dim=256, n_layers=2, n_heads=16, n_kv_heads=8, ffn_dim=512),
    "small-llama": dict(vocab_size=4096, dim=512, n_layers=4, n_heads=16, n_kv_heads=8, ffn_dim=1408),
    # GPU-sized (d=1024, ffn=4096: the shapes of an early H200 measurement), fewer layers.
    "medium-llama": dict(vocab_size=8192, dim=1024, n_layers=2, n_heads=16, n_kv_heads=8, ffn_dim=4096),
    # ~0.9B parameters, for the fix-cost benchmark on GPUs.
    "llama-1b": dict(vocab_size=32000, dim=2048, n_layers=16, n_heads=16, n_kv_heads=8, ffn_dim=5632),
}
