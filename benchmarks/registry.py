"""The jobs, by name. Modules are imported only when their job runs, so a job can be
registered before its module lands (its run then says so in one line)."""
from __future__ import annotations

from dataclasses import dataclass, field

INTERP = {"TRITON_INTERPRET": "1"}


@dataclass(frozen=True)
class Job:
    module: str
    summary: str
    needs: str  # what it runs on: "CUDA", "CUDA, --smoke on CPU", "CPU or CUDA", ...
    prefix: tuple[str, ...] = ()  # arguments put before the user's (a preset of a shared module)
    smoke_env: dict = field(default_factory=dict)  # set under --smoke before the module is imported
    # `--table JOB`'s default figure columns: fnmatch patterns on dotted paths (benchmarks/table.py)
    table: tuple[str, ...] = ("ok",)

    def to_dict(self) -> dict:
        return {"module": self.module, "summary": self.summary, "needs": self.needs,
                "prefix": list(self.prefix)}


JOBS: dict[str, Job] = {
    "fix-cost": Job("benchmarks.jobs.fix_cost",
                    "llama-1b training step, every fix alone and all together vs stock, interleaved; "
                    "batch 8 x seq 4096 and 1 x 2048; MFU", "CUDA >= 2 GPUs (NCCL); --smoke on CPU (gloo)",
                    table=("tp", "batch", "seq", "stock_mfu", "configs.stock.ms", "configs.*.x_stock")),
    "switch-cost": Job("benchmarks.jobs.fix_cost", "tpdiag.invariant around a user's own training loop "
                       "vs that loop without tpdiag (fix-cost --loop user): llama-1b, 8 x 4096, TP=2; "
                       "ms/step, x stock, stock MFU", "CUDA >= 2 GPUs (NCCL); --smoke on CPU (gloo)",
                       prefix=("--loop", "user", "--tp", "2"),  # --loop user's default size: 8 x 4096
                       table=("tp", "batch", "seq", "stock_mfu", "configs.stock.ms", "configs.*.x_stock")),
    "gemm": Job("benchmarks.jobs.gemm", "invariant-gemm (triton_mm) vs cuBLAS: speed, accuracy, bitwise "
                "invariance; --sweep tile configs", "CUDA; --smoke on CPU (Triton interpreter)", smoke_env=INTERP,
                table=("dtype", "label", "cublas_ms", "triton_ms", "ratio", "err_triton", "err_cublas")),
    "probes": Job("benchmarks.jobs.probes", "probe cost: overhead (none/hash/full step time, memory, MFU), "
                  "hash, hash-sweep, launch, profile, diff RUN_DIR", "overhead/diff: CPU or CUDA; others CUDA",
                  table=("what", "model", "dtype", "batch", "seq", "rounds", "rest_ms", "mfu_no_probes",
                         "modes.*.step_ms", "modes.*.paired_ratio", "modes.*.paired_ms")),
    "tree-kernels": Job("benchmarks.jobs.tree_kernels", "tree fixes' Triton kernels: bitwise TP invariance, "
                        "float64 accuracy, speed vs torch path", "CUDA; --smoke on CPU (Triton interpreter)",
                        smoke_env={"TRITON_INTERPRET": "1", "TPDIAG_TRITON_CPU": "1"}),
    "record-hash": Job("benchmarks.jobs.record_hash", "record-hash Triton kernel == torch path bit for bit, "
                       "shards add up, queued HashBuffer launches", "CUDA",
                       table=("mismatches", "queued_mismatches", "records_queued", "stale", "ok")),
    "hash-collisions": Job("benchmarks.jobs.hash_collisions", "record-hash lane mixes (v1, v2 and two "
                           "rejected) under TP-like perturbations: collision rates at truncated widths "
                           "against a random function's", "CPU (numpy); args: [TRIALS] [PAIR_TRIALS]"),
    "hash-variants": Job("benchmarks.jobs.hash_variants", "record-hash kernels' compiled variants that a "
                         "compare's records need (default: llama-1b bf16 1 x 2048 TP=1,2 shapes) and which the "
                         "warm-up compiles, counted from shapes through the launch paths; --base REV: before/after",
                         "CPU; args: [RECORDS] [--base REV]", table=("records", "runs.*.variants", "runs.*.not_warmed")),
    "oracle-threshold": Job("benchmarks.jobs.oracle_threshold", "the float64 verdict's threshold: the smallest "
                            "planted error (scale, one head) still called a bug, bf16 and float32, by record "
                            "size; the correct reordering's ratio beside it", "CPU; args: [SEEDS]",
                            table=("seeds", "ok")),
    "tree-gemm": Job("benchmarks.jobs.tree_gemm", "tp-invariant-linear's group GEMM: tree_mm tiles vs "
                     "per-group invariant-gemm vs cuBLAS, llama-1b TP=2 shapes", "CUDA",
                     table=("tp", "case", "M", "K", "N", "cublas.ms", "variants.*.x_cublas", "variants.*.bitwise")),
    "split-gemm": Job("benchmarks.jobs.split_gemm", "pre-split bf16x6/bf16x9 fp32 GEMM: error sources and "
                      "speed vs cuBLAS fp32 at 4096^3", "CUDA"),
    "compare": Job("benchmarks.jobs.compare", "`tpdiag compare` runs, one summary row each (--set 1b, "
                   "matrix, fix-all, hf, more; wall time, verdict, first divergence)",
                   "CUDA (NCCL); --smoke on CPU (gloo)",
                   table=("set", "run", "rc", "status", "capture", "wall_s", "phases.compare_s")),
    "compare-1b": Job("benchmarks.jobs.compare", "`tpdiag compare` on llama-1b bf16 batch 1 x seq 2048, "
                      "default flow (= compare --set 1b)", "CUDA (NCCL), one GPU per degree",
                      prefix=("--set", "1b"), table=("tp", "run", "rc", "status", "capture", "wall_s", "phases.compare_s")),
    "time-breakdown": Job("benchmarks.jobs.compare", "where a compare's time goes: llama-1b and an 8B-shaped "
                          "hf: config (4 layers, then all 32), bf16 1 x 2048, TP=1,1 on one GPU, the "
                          "manifest's time_breakdown printed per run (= compare --set time)",
                          "CUDA (NCCL), one GPU; --tp 1,2,4 for more", prefix=("--set", "time"),
                          table=("run", "rc", "status", "wall_s", "time_breakdown.wall_s",
                                 "time_breakdown.totals.*")),
    "attention": Job("benchmarks.attention", "attention fix benchmark; --configs d64: candidate tiles at "
                     "D=64/128 vs stock SDPA", "CUDA; --configs d64 --smoke on CPU (Triton interpreter)",
                     smoke_env=INTERP,
                      table=("meta.shape", "meta.dtype", "backends.*.fwdbwd_ms", "backends.*.ratio_to_fastest_stock")),
    "rollout": Job("benchmarks.jobs.rollout", "`tpdiag rollout` speed: generate() on a Llama-3.2-1B-shaped bf16 "
                   "checkpoint, then the rollout grid per --jobs value: seconds and forward MFU per "
                   "configuration, the logprobs bit for bit across --jobs", "CUDA; --small --device cpu on CPU",
                   table=("tp", "fix", "generate_s", "runs.*.jobs", "runs.*.wall_s", "runs.*.same_bits_as_first")),
    "suite": Job("benchmarks.jobs.suite", "several jobs in one device call (NCCL_NVLS_ENABLE=0, wheels "
                 "from .whl, per-job time limits, logs and results under $OUT)", "whatever its jobs need",
                 table=("job", "rc", "wall_s")),
}
