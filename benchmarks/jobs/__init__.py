"""The job modules: each exposes main(argv) -> dict of figures (benchmarks/registry.py names them)."""
