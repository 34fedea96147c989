"""Run configuration: frozen, validated, serialisable (`to_dict`) so every record shows its provenance."""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

from tpdiag.errors import BadInput

DTYPES = ("float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
GRANULARITIES = ("module", "op", "auto")
CAPTURES = ("auto", "full", "hash")
# --capture auto: hash-first above this many parameters (whole records of a 1B model are GBs)
AUTO_HASH_PARAMS = 100_000_000
FORMATS = ("text", "json")


def parse_degrees(text: str, at_least: int = 2) -> tuple[int, ...]:
    """'1,2,4,8' -> (1, 2, 4, 8). The first is the reference; repeats are allowed (self-baseline).
    at_least=1 where another axis (--micro-batch) gives the configurations to compare."""
    parts = [p.strip() for p in str(text).split(",")]
    if not parts or any(p == "" for p in parts):
        raise BadInput(f"--tp {text!r}: expected a comma-separated list of positive integers, e.g. 1,2,4,8")
    out = []
    for p in parts:
        try:
            out.append(int(p))
        except ValueError:
            raise BadInput(f"--tp {text!r}: {p!r} is not an integer; expected e.g. 1,2,4,8") from None
    for n in out:
        if n < 1:
            raise BadInput(f"--tp {text!r}: degree {n} must be >= 1")
    if len(out) < at_least:
        raise BadInput(f"--tp {text!r}: need at least two degrees (a reference and one to compare), e.g. 1,2")
    return tuple(out)


def parse_choice(option: str, value: str, choices: tuple[str, ...]) -> str:
    v = str(value).strip().lower()
    aliases = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
    v = aliases.get(v, v) if choices is DTYPES else v
    if v not in choices:
        raise BadInput(f"{option} {value!r}: expected one of {', '.join(choices)}")
    return v


def _plain(v):
    """A value as JSON holds it: tuples, nested ones too, as lists."""
    if isinstance(v, (tuple, list)):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    return v


def _frozen(v):
    """A JSON list back as the tuple the frozen config holds, nested ones too."""
    return tuple(_frozen(x) for x in v) if isinstance(v, list) else v


def to_dict(cfg, omitted: dict) -> dict:
    """A config's fields, in order, as JSON holds them; a field in `omitted` is left out while it
    has that value (a field added later: the files of a run without it stay as they were)."""
    return {f.name: _plain(getattr(cfg, f.name)) for f in fields(cfg)
            if not (f.name in omitted and getattr(cfg, f.name) == omitted[f.name])}


def from_dict(cls, d: dict):
    """to_dict's inverse: a tuple field's list back as a tuple. A key of a newer tpdiag is refused
    by the dataclass, as before."""
    tuples = {f.name for f in fields(cls) if isinstance(f.default, tuple)}
    return cls(**{k: (_frozen(v) if k in tuples else v) for k, v in d.items()})


def degree_labels(degrees: tuple[int, ...]) -> list[str]:
    """The TP axis' summary keys ('2'; folders 'tp2'): a repeated degree is the same configuration
    run again ('1-2', tpdiag.base.configs.Config.repeat) so runs never collide."""
    from tpdiag.base.configs import Config

    seen: dict[int, int] = {}
    labels = []
    for d in degrees:
        seen[d] = seen.get(d, 0) + 1
        labels.append(Config(d, repeat="" if seen[d] == 1 else str(seen[d])).compare_key(Config(d)))
    return labels


@dataclass(frozen=True)
class WorldConfig:
    """Everything one TP world needs; crosses the process boundary as a plain dict."""

    model: str
    degree: int
    label: str
    out_dir: str
    dtype: str = "float32"
    device: str = "cpu"
    backward: bool = True
    steps: int = 1
    seed: int = 1234
    batch_size: int = 2
    seq_len: int = 16
    lr: float = 1e-2
    clip_norm: float | None = 1.0
    fixes: tuple[str, ...] = ()
    granularity: str = "module"
    variant: str = "stock"
    probes: bool = True
    selfcheck: bool = True
    op_include: tuple[str, ...] = ()  # with granularity op: only ops inside these modules/phases
    capture: str = "full"              # full | hash | auto (by parameter count)
    module_include: tuple[str, ...] = ()  # probe only these modules (a second, full pass)
    ref_dir: str = ""                  # the reference's records: whole shapes for hash mode
    # the run's tree groups G and group GEMM (fixes/groups.py); 0 / "": TPDIAG_TREE_GROUPS or 8, fused
    tree_groups: int = 0
    group_gemm: str = ""
    # float64 oracle (probes/float64.py): these modules' calls, and with oracle_ops every op
    # recorded in op_include's scopes, re-executed in float64 (the reference world only)
    oracle: tuple[str, ...] = ()
    oracle_ops: bool = False
    # ... and the same modules again from each other world's own recorded inputs: (label, file
    # of that world's whole inputs and output grads, diff/own_inputs.py)
    oracle_own: tuple[tuple[str, str], ...] = ()
    # the axes besides TP (tpdiag/base/points.py): sequences per forward call (0: the whole batch in
    # one call) and how the sequence goes through the model
    micro_batch: int = 0
    mode: str = "prefill"
    # a decode comparison on positions [0, positions) only (0: the whole sequence): decode
    # worlds make the prompt call and the one-token calls before it; the prefill reference runs
    # the whole sequence and records those positions of the records prefix_from's decode world
    # placed (runner/prefix.py)
    positions: int = 0
    prefix_from: str = ""
    # backend flags (runner/flags.py): 'deterministic' (compare's) or PyTorch's 'default'
    flags: str = "deterministic"
    layers: int = 0  # --layers N: the model's first N decoder layers (models/slice.py); 0: all
    # the attention implementation (runner/attention.py; the --attention axis); 'auto': the model's own
    attention: str = "auto"

    def to_dict(self) -> dict:
        return to_dict(self, {"attention": "auto"})  # world.json as before the axis existed

    @classmethod
    def from_dict(cls, d: dict) -> "WorldConfig":
        return from_dict(cls, d)

    def with_(self, **kw) -> "WorldConfig":
        return replace(self, **kw)


@dataclass(frozen=True)
class CompareConfig:
    model: str = "tiny-llama"
    degrees: tuple[int, ...] = (1, 2, 4, 8)
    dtype: str = "float32"
    device: str = "auto"
    backward: bool = True
    steps: int = 1
    fixes: tuple[str, ...] = ()
    fix_mode: str = "none"  # none | explicit | all | auto
    confirm: bool = True
    granularity: str = "module"
    out: str = ""
    timeout: float = 300.0
    seed: int = 1234
    batch_size: int = 2
    seq_len: int = 16
    variant: str = "stock"
    baseline: bool = True  # rerun the reference against itself before blaming TP
    op_include: tuple[str, ...] = ()
    capture: str = "auto"
    module_include: tuple[str, ...] = ()
    extra: dict = field(default_factory=dict)
    tree_groups: int = 0  # G of the invariant fixes; 0: chosen per run (fixes/groups.py)
    group_gemm: str = ""  # per-group | fused, chosen with G
    # rerun each world's step unprobed to prove the probes change nothing; the region pass
    # compares step fingerprints with the first pass instead (runner/drill.py)
    selfcheck: bool = True
    oracle: tuple[str, ...] = ()  # the second pass: modules the reference re-executes in float64
    oracle_ops: bool = False      # ... and every op it records (op_include's scopes)
    oracle_own: tuple[tuple[str, str], ...] = ()  # ... and from these worlds' inputs (WorldConfig)
    # the other axes (tpdiag/base/points.py): () = the whole batch per call; the first is the reference's
    micro_batches: tuple[int, ...] = ()
    modes: tuple[str, ...] = ("prefill",)
    grid: bool = False            # every combination of the axes, not one axis at a time
    only: tuple[str, ...] = ()    # reruns (second pass, confirm): just these labels beside the reference
    positions: int = 0            # reruns of decode configurations: the first positions only
    prefix_from: str = ""         # ... placed as in this earlier decode world (runner/prefix.py)
    flags: str = "deterministic"  # backend flags of every world (runner/flags.py)
    layers: int = 0               # --layers N: the first N decoder layers (models/slice.py); 0: all
    # the second pass also re-executes each divergent module past the first divergence in float64
    # from each side's own inputs (diff/own_inputs.py): a bug behind a harmless reordering is a
    # bug without any flag; --no-judge-downstream turns it off (only the first divergence judged)
    judge_downstream: bool = True
    # the attention implementations (runner/attention.py) and padding sides (refused: compare's
    # sequences carry no padding) as axes; () = the model's own attention
    attentions: tuple[str, ...] = ()
    paddings: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        return to_dict(self, {"attentions": (), "paddings": ()})  # manifest.json as before these axes

    @classmethod
    def from_dict(cls, d: dict) -> "CompareConfig":
        """A manifest's config (lists where tuples were)."""
        return from_dict(cls, d)

    def worlds(self):
        """Every configuration this compare runs, the reference first (tpdiag/base/points.py)."""
        from tpdiag.base.points import worlds

        out = worlds(self.degrees, self.micro_batches, self.modes, self.grid, degree_labels,
                     attentions=self.attentions, paddings=self.paddings, flags=self.flags,
                     fix="+".join(self.fixes) or "none")
        if self.only:
            out = [out[0]] + [w for w in out[1:] if w.label in self.only]
        return out

    def world(self, degree: int, label: str, out_dir: str, device: str, **kw) -> WorldConfig:
        # decode has no backward (an engine's token-by-token logprobs): its worlds run forward
        # only whatever --backward says; the other worlds run the whole step
        backward = self.backward and kw.get("mode") != "decode"
        return WorldConfig(model=self.model, degree=degree, label=label, out_dir=out_dir,
                           dtype=self.dtype, device=device, backward=backward,
                           steps=self.steps, seed=self.seed, batch_size=self.batch_size,
                           seq_len=self.seq_len, fixes=self.fixes, granularity=self.granularity,
                           variant=self.variant, op_include=self.op_include,
                           capture=self.capture, module_include=self.module_include,
                           tree_groups=self.tree_groups, group_gemm=self.group_gemm,
                           selfcheck=self.selfcheck, positions=self.positions,
                           prefix_from=self.prefix_from, flags=self.flags, layers=self.layers, **kw)
