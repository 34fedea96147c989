"""tpdiag's benchmark suite: named jobs behind one entry point.

    python -m benchmarks --list
    python -m benchmarks <job> [job args]        # e.g. fix-cost, gemm, probes overhead

Each job prints its table and appends one JSON line (date, host, GPU, versions, commit, args,
figures) to benchmarks/results.jsonl (and to $OUT/results.jsonl when OUT is set). See
docs/benchmark-suite.md, "How to run"; `python -m benchmarks --table JOB` prints a job's recorded runs.
"""
