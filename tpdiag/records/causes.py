"""The cause registry: every cause label with its class, the sentence that explains it, the
short name narrow tables print, and the advice when no fix applies - the contract summary.json,
the gate, the exit codes, the CLI, the report and docs/causes.md share (a test checks the docs
and DESIGN.md name exactly these labels).

Every cause is in one class (DESIGN.md, "Causes"): a **bug** is a wrong result (fix the code),
**non-finite** is NaN/Inf on one side only (never within any budget), **rounding** is a
reordered or re-blocked computation of the same function (harmless unless bitwise equality is
needed), and **unknown** means nothing could be judged (it always carries a reason).

The fixes that confirm a cause are declared by the fixes themselves (fixes/catalogue.py: the
causes each removes, and batch_invariant) and read with fixes/registry.py's fixes_for_cause, so
that fact too has one place. Which cause a record gets is the judging passes' business (diff/).
"""
from __future__ import annotations

from dataclasses import dataclass

CLASSES = ("bug", "non-finite", "rounding", "unknown")

# Exit code of `gate` and `compare --fail-on-divergence` when a bug-class or non-finite finding is
# beyond policy (1 stays "divergence beyond policy", 2 inconclusive, 3 environment).
EXIT_BUG = 4


@dataclass(frozen=True)
class Cause:
    label: str
    cls: str  # one of CLASSES
    why: str  # the mechanism, one sentence: where the user should look
    short: str = ""  # the label in a narrow table cell ("": the label itself)
    action: str | None = None  # the advice when no fix applies (a bug, a consequence, unknown)

    def __post_init__(self):
        if self.cls not in CLASSES:
            raise ValueError(f"cause {self.label}: class {self.cls!r}, expected one of {CLASSES}")
        if not self.short:
            object.__setattr__(self, "short", self.label)


REGISTRY: dict[str, Cause] = {}


def register(cause: Cause) -> Cause:
    REGISTRY[cause.label] = cause
    return cause


register(Cause('row-parallel-reduction', 'rounding',
               'a row-parallel layer computes partial sums over its K shard and all-reduces them, so TP '
               'changes the order of the K summation',
               short='row-par-reduce'))
register(Cause('shape-dependent-gemm', 'rounding',
               'a column-parallel GEMM ran on a narrower shard and the GEMM kernel chose a different '
               'tiling or split-K for that shape; no communication is involved',
               short='shape-gemm'))
register(Cause('vocab-parallel-softmax', 'rounding',
               'the loss and logprobs reduce max and sum-of-exp over vocabulary shards in a different '
               'order than one full softmax',
               short='vocab-softmax'))
register(Cause('column-parallel-dgrad', 'rounding',
               'the input gradient of a column-parallel layer is a sum over output shards, all-reduced '
               'across ranks in a different order',
               short='col-par-dgrad'))
register(Cause('norm-weight-grad', 'rounding',
               'the weight gradient of a replicated norm sums per-token terms that are split across '
               'ranks'))
register(Cause('grad-norm', 'rounding',
               'the global gradient norm sums per-shard squared norms in a different order, so the clip '
               'coefficient differs'))
register(Cause('collective-nondeterminism', 'rounding',
               'the reference does not reproduce itself: a collective or kernel is nondeterministic '
               '(check `tpdiag doctor`)'))
register(Cause('rank-inconsistent-replica', 'bug',
               'a tensor that must be identical on every rank differs between ranks of one world (a '
               'missing broadcast or all-reduce, or a nondeterministic kernel)',
               action="Find which rank's copy is wrong: the replica must be written by the same code on "
                      'every rank (broadcast it, or make the kernel deterministic).'))
register(Cause('router-flip', 'rounding',
               "an MoE router's top-k chose other experts for some tokens because its input differed "
               'within rounding upstream (a near-tie between the k-th and (k+1)-th score): a consequence'
               ' of the first divergence, not a bug in the router',
               action='Fix the root cause upstream (the first divergence); a TP-invariant path up to the '
                      'router keeps every expert choice.'))
register(Cause('sharding-bug', 'bug',
               'the difference is far beyond the rounding bound of a reordered sum: a wrong result '
               '(wrong shard, missing or doubled reduction, wrong scale), not a reordering',
               action="Check this module's entry in the TP plan, or its hand-written collectives "
                      '(input/output layouts, which dimension is sharded, the order of gathered shards, '
                      'whether a reduction is missing or a bias or scale is applied per rank) - no '
                      'numerical fix applies to a wrong result.'))
register(Cause('unknown', 'unknown',
               'tpdiag cannot name the cause from the layout alone',
               action='Nothing could judge it (the reason is above). `tpdiag compare` re-executes a first '
                      'divergence without a verdict in float64 and records its ops by itself; a capture '
                      'made with `tpdiag.capture` cannot be re-executed.'))
register(Cause('attention-kernel', 'rounding',
               'an attention kernel (scaled-dot-product / flash / efficient / cuDNN / flex) gave other '
               'bits for bitwise-equal inputs: its result depends on the heads or batch per call, or its'
               ' backward is not deterministic'))
register(Cause('nondeterministic-kernel', 'rounding',
               'the reference does not reproduce itself and the first difference is an op, not a '
               'collective: a nondeterministic kernel (atomics, split reductions)'))
# the module's own forward may communicate: a norm on DTensors over a sharded q all-reduces its
# mean's partial sums (tests/test_hf_user_archs.py dtensor_norm, 3 ULP) - named too, a few ULP
register(Cause('shape-dependent-kernel', 'rounding',
               'a module with no layout (an elementwise activation, a norm, ...) gave other bits, a few '
               "ULP, for bitwise-equal inputs and parameters: its result depends on the rank's local "
               'shape - a kernel took another code path for the narrower shard (on CPU a vectorised body '
               'vs a scalar tail), or the module reduced over a sharded dimension in its own forward '
               "(DTensor all-reducing a norm's partial sums)"))
register(Cause('batch-variant-kernel', 'rounding',
               "a kernel's result for a row depends on how many rows share its call (micro-batch size, "
               'decode vs prefill)'))
register(Cause('non-finite', 'non-finite',
               'a NaN or Inf (at one side, or at both: bitwise-equal NaN is still NaN): never rounding'))

# the labels known at import, in registration order (live queries: labels(), of_class())
CAUSES = tuple(REGISTRY)


def labels() -> tuple[str, ...]:
    return tuple(REGISTRY)


def of_class(cls: str) -> tuple[str, ...]:
    return tuple(c.label for c in REGISTRY.values() if c.cls == cls)


def get(label: str | None) -> Cause:
    """The entry of `label`; None, and a label this build does not know, read as unknown."""
    return REGISTRY.get(label or "unknown") or REGISTRY["unknown"]


def cause_class(cause: str | None) -> str:
    if cause is None or cause == "unknown":
        return "unknown"
    # a label this build does not register (a newer run's) reads as rounding, as it always has
    entry = REGISTRY.get(cause)
    return entry.cls if entry is not None else "rounding"


# the classes from the gravest: the run's headline is its gravest class, and a finding is grouped under
# the one it follows only where that one is at least as grave
GRAVITY = ("bug", "non-finite", "unknown", "rounding")


def groups_under(cause: str | None, root_cause: str | None) -> bool:
    """Whether a finding of `cause` that follows one of `root_cause` is grouped under it (not judged
    on its own): the gate's rule (gate/findings.grouped) and the headline's (diff/classes.roots), in one
    place. Only under one at least as grave: a bug under a bug, a NaN under a bug or a NaN, an
    `unknown` under anything but rounding - an unknown is not judged, and a rounding root that
    absorbed it passed `--allow rounding` with it (a bf16 share near the reference after a router
    flip) - and a rounding difference under anything. A bug under an `unknown` root stays a root
    of its own: the gate judges it (exit 4), so the headline says BUG."""
    rank = {c: i for i, c in enumerate(GRAVITY)}
    return rank[cause_class(root_cause)] <= rank[cause_class(cause)]


def short_name(cause: str) -> str:
    entry = REGISTRY.get(cause)
    return entry.short if entry is not None else cause
