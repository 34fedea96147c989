"""Run configuration: frozen, validated, serialisable (`to_dict`) so every record shows its provenance.

A configuration is nested: the user's run settings (RunSettings), the configuration point (a
compare's Axes, a world's tpdiag.base.configs.Config), and what only tpdiag's own reruns set
(RerunSpec); on disk it is the flat dict the run directory has always held (_Nested)."""
from __future__ import annotations

import functools
from dataclasses import dataclass, field, fields, replace

from tpdiag.base.configs import Config
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


def degree_labels(degrees: tuple[int, ...]) -> list[str]:
    """The TP axis' summary keys ('2'; folders 'tp2'): a repeated degree is the same configuration
    run again ('1-2', tpdiag.base.configs.Config.repeat) so runs never collide."""
    seen: dict[int, int] = {}
    labels = []
    for d in degrees:
        seen[d] = seen.get(d, 0) + 1
        labels.append(Config(d, repeat="" if seen[d] == 1 else str(seen[d])).compare_key(Config(d)))
    return labels


class _Nested:
    """A configuration made of parts (dataclasses: the user's settings, the configuration point or
    axes, the rerun spec) and fields of its own. On disk (manifest.json's `config`, world.json's)
    it is one flat dict, keyed and ordered as before the parts existed; a part's field is read
    flat (`cfg.dtype`), except the rerun spec's, which only tpdiag's own passes set and read
    (`cfg.rerun.oracle`)."""

    _PARTS: dict = {}       # part field -> its dataclass, in build order
    _RENAMED: dict = {}     # (part, field) -> its flat key; None: no key of its own (derived)
    _DEFAULTS: dict = {}    # flat key -> this config's default where the part's is another
    _OMITTED: dict = {}     # flat key -> the value at which to_dict leaves it out (added later)
    # flat key -> its value where a file lacks it, where that is not today's default: a file written
    # before the default changed (or with the key left out at its _OMITTED value) ran that way
    _ABSENT: dict = {}
    _FILE_ORDER: tuple = ()  # the flat keys in the order the run directory's files hold them
    _INTERNAL = ("rerun",)  # parts not read flat

    @classmethod
    def of(cls, **flat):
        """The config from flat keys (the files' form; a whole part may be given by its name)."""
        lay = _layout(cls)
        own: dict = {}
        kw: dict = {p: {} for p in cls._PARTS}
        for k, v in {**cls._DEFAULTS, **flat}.items():
            if k in cls._PARTS:
                own[k] = v
            elif k not in lay:
                raise TypeError(f"{cls.__name__} has no setting {k!r}")
            elif lay[k][0] is None:
                own[k] = v
            else:
                kw[lay[k][0]][lay[k][1]] = v
        for p, part in cls._PARTS.items():
            if p not in own:
                own[p] = part(**kw[p])
            elif kw[p]:
                own[p] = replace(own[p], **kw[p])
        return cls(**own)._synced()

    def with_(self, **kw):
        """A copy with these flat keys (or whole parts) changed."""
        lay = _layout(type(self))
        own: dict = {}
        parts: dict = {}
        for k, v in kw.items():
            if k in self._PARTS or (k in lay and lay[k][0] is None):
                own[k] = v
            elif k in lay:
                parts.setdefault(lay[k][0], {})[lay[k][1]] = v
            else:
                raise TypeError(f"{type(self).__name__} has no setting {k!r}")
        for p, sub in parts.items():
            own[p] = replace(own.get(p, getattr(self, p)), **sub)
        return replace(self, **own)._synced()

    def _synced(self):
        return self

    def to_dict(self) -> dict:
        """The flat dict the run directory's files hold: every key, JSON's lists for tuples, in the
        files' order (a key added since after them)."""
        vals = {}
        for k, (part, name, _) in _layout(type(self)).items():
            v = getattr(self if part is None else getattr(self, part), name)
            if not (k in self._OMITTED and v == self._OMITTED[k]):
                vals[k] = _plain(v)
        order = {k: i for i, k in enumerate(self._FILE_ORDER)}
        return dict(sorted(vals.items(), key=lambda kv: order.get(kv[0], len(order))))

    @classmethod
    def from_dict(cls, d: dict):
        """to_dict's inverse (also of what an older tpdiag wrote: a key added since takes its
        default); a key this tpdiag does not know (a newer one wrote it) is refused."""
        lay = _layout(cls)
        unknown = [k for k in d if k not in lay and k not in cls._PARTS]
        if unknown:
            raise BadInput(f"the run's config has {', '.join(map(repr, unknown))}, which this tpdiag does not "
                           "know (written by a newer tpdiag?)")
        return cls.of(**{k: (_frozen(v) if k in lay and isinstance(lay[k][2].default, tuple) else v)
                         for k, v in {**cls._ABSENT, **d}.items()})

    def __getattr__(self, name: str):
        # called only where normal lookup failed: a part's field, read flat
        cls = type(self)
        if name.startswith("__") or name in cls._PARTS:
            raise AttributeError(name)
        loc = _layout(cls).get(name)
        if loc is None or loc[0] is None:
            raise AttributeError(f"{cls.__name__} has no {name!r}")
        if loc[0] in cls._INTERNAL:
            raise AttributeError(f"{cls.__name__}.{name} is the rerun spec's: read .{loc[0]}.{loc[1]}")
        return getattr(object.__getattribute__(self, loc[0]), loc[1])


@functools.cache
def _layout(cls) -> dict:
    """flat key -> (part or None, its field's name, the field) of a _Nested config class."""
    out: dict = {}
    for f in fields(cls):
        part = cls._PARTS.get(f.name)
        items = [(None, f.name, f)] if part is None else \
            [(f.name, g.name, g) for g in fields(part)]
        for p, name, g in items:
            key = cls._RENAMED.get((p, name), name) if p else name
            if key is None:
                continue
            if key in out:
                raise TypeError(f"{cls.__name__}: flat key {key!r} is in two parts")
            out[key] = (p, name, g)
    return out


@dataclass(frozen=True)
class RunSettings:
    """The user's run settings that every world of the run shares (compare's options less its axes
    and what the command does around its passes). Every knob that changes numerics is a field
    here, so recorded in manifest.json's and world.json's `config`."""

    model: str = "tiny-llama"
    dtype: str = "float32"
    device: str = "auto"
    backward: bool = True
    steps: int = 1
    seed: int = 1234
    batch_size: int = 2
    seq_len: int = 16
    fixes: tuple[str, ...] = ()
    granularity: str = "module"
    variant: str = "stock"
    capture: str = "auto"              # full | hash | auto (by parameter count)
    # the run's tree groups G and group GEMM (fixes/groups.py); 0 / "": chosen per run (a world:
    # TPDIAG_TREE_GROUPS or 8, fused)
    tree_groups: int = 0
    group_gemm: str = ""
    flags: str = "deterministic"       # backend flags of every world (runner/flags.py)
    layers: int = 0                    # --layers N: the first N decoder layers (models/slice.py); 0: all
    # the trainer's logprob recipe of the recorded logprobs (--logprob, runner/recipe.py), rollout's
    logprob: str = "log-softmax"
    trainer_temperature: float = 1.0
    temperature_in: str = "float32"
    logprob_compiled: bool = False     # --compiled: the recipe under torch.compile(dynamic=True)
    # each later step of a TP > 1 world starts from the reference's state (runner/anchor.py): without
    # it a later step's records move by the updates' drift too, which no bound separates from its own
    # code's (docs/causes.md, Later steps); --no-anchor: each side trains on its own
    anchor: bool = True


# the default recipe's keys are left out of the files: a run directory of the default recipe is
# the one an older tpdiag wrote, and an older one (no keys) reads as the default recipe
RECIPE_OMITTED = {"logprob": "log-softmax", "trainer_temperature": 1.0, "temperature_in": "float32",
                  "logprob_compiled": False}


@dataclass(frozen=True)
class RerunSpec:
    """What only tpdiag's own passes set - drill's second pass, confirm's rounds (and rollout's
    recompute worlds, which need no self-check) - never a user's option. The user's run has the
    defaults."""

    only: tuple[str, ...] = ()           # just these configurations' labels beside the reference
    positions: int = 0                   # decode configurations: the first positions only
    prefix_from: str = ""                # ... placed as in this earlier decode world (runner/prefix.py)
    # float64 oracle (probes/float64.py): these modules' calls, and with oracle_ops every op
    # recorded in op_include's scopes, re-executed in float64 (the reference world only)
    oracle: tuple[str, ...] = ()
    oracle_ops: bool = False
    # ... and the same modules again from each other world's own recorded inputs: (label, file
    # of that world's whole inputs and output grads, diff/own_inputs.py)
    oracle_own: tuple[tuple[str, str], ...] = ()
    module_include: tuple[str, ...] = ()  # probe only these modules (a second, full pass)
    op_include: tuple[str, ...] = ()      # with granularity op: only ops inside these modules/phases
    # rerun each world's step unprobed to prove the probes change nothing; the region pass
    # compares step fingerprints with the first pass instead (runner/drill.py)
    selfcheck: bool = True
    # the folder below its run of a rerun that ran what the user did not ask for - a confirmation
    # (confirm/<fix>), a fix chain's round (auto/round<i>), a matrix variant (variants/<slug>) - and of
    # the second passes inside it; "": the user's run. Copied out of its run such a folder is whole by
    # its files, and gated alone it read as the user's run (records/nested.py refuses it)
    pass_of: str = ""


@dataclass(frozen=True)
class Axes:
    """The axes one compare spans: each world is a point on them (tpdiag/base/points.py)."""

    degrees: tuple[int, ...] = (1, 2, 4, 8)
    # () = the whole batch per call; the first is the reference's
    micro_batches: tuple[int, ...] = ()
    modes: tuple[str, ...] = ("prefill",)
    grid: bool = False            # every combination of the axes, not one axis at a time
    # the attention implementations (runner/attention.py) and padding sides (refused: compare's
    # sequences carry no padding); () = the model's own attention
    attentions: tuple[str, ...] = ()
    paddings: tuple[str, ...] = ()


@dataclass(frozen=True)
class WorldConfig(_Nested):
    """Everything one TP world needs: the run's settings, its configuration point, where it writes,
    and what a rerun asks of it; crosses the process boundary as the flat dict (world.json's)."""

    settings: RunSettings = field(default_factory=RunSettings)
    # its fix and flags are the settings' (kept in step by _synced); its repeat is in the label
    point: Config = field(default_factory=lambda: Config(1))
    label: str = ""
    out_dir: str = ""
    ref_dir: str = ""                  # the reference's records: whole shapes for hash mode
    lr: float = 1e-2
    clip_norm: float | None = 1.0
    probes: bool = True
    rerun: RerunSpec = field(default_factory=RerunSpec)
    # the own-input pass's reference (runner/drill.py): the folder of the region pass's reference,
    # whose records this world's step would write again byte for byte (the same probes, the same
    # step: its fingerprint); this world writes only its float64 ("oracle") records and its record
    # set reads the rest from there (records/store.py: RecordSet)
    records_base: str = ""

    _PARTS = {"settings": RunSettings, "point": Config, "rerun": RerunSpec}
    _RENAMED = {("point", "tp"): "degree", ("point", "fix"): None, ("point", "flags"): None,
                ("point", "repeat"): None}
    _DEFAULTS = {"device": "cpu", "capture": "full"}
    # world.json as before these existed: a world selects no worlds; the axes it did not have
    _OMITTED = {"only": (), "attention": "auto", "padding": "auto", "records_base": "", "anchor": False,
                "pass_of": "", **RECIPE_OMITTED}
    _ABSENT = {"anchor": False}  # left out: --no-anchor, or a run from before the anchor was the default
    _FILE_ORDER = ("model", "degree", "label", "out_dir", "dtype", "device", "backward", "steps", "seed",
                   "batch_size", "seq_len", "lr", "clip_norm", "fixes", "granularity", "variant", "probes",
                   "selfcheck", "op_include", "capture", "module_include", "ref_dir", "tree_groups",
                   "group_gemm", "oracle", "oracle_ops", "oracle_own", "micro_batch", "mode", "positions",
                   "prefix_from", "flags", "layers", "attention", "records_base", *RECIPE_OMITTED, "anchor",
                   "pass_of")

    def _synced(self) -> "WorldConfig":
        s = self.settings
        fix = "+".join(s.fixes) or "none"
        if (self.point.fix, self.point.flags, self.point.repeat) == (fix, s.flags, ""):
            return self
        return replace(self, point=replace(self.point, fix=fix, flags=s.flags, repeat=""))


@dataclass(frozen=True)
class CompareConfig(_Nested):
    """`tpdiag compare`'s configuration: the user's settings, the axes its worlds lie on, what the
    command does around its passes, and (a rerun of tpdiag's own only) the rerun spec."""

    settings: RunSettings = field(default_factory=RunSettings)
    axes: Axes = field(default_factory=Axes)
    fix_mode: str = "none"  # none | explicit | all | auto
    confirm: bool = True
    out: str = ""
    timeout: float = 300.0
    baseline: bool = True  # rerun the reference against itself before blaming TP
    # the second pass also re-executes each divergent module past the first divergence in float64
    # from each side's own inputs (diff/own_inputs.py): a bug behind a harmless reordering is a
    # bug without any flag; --no-judge-downstream turns it off (only the first divergence judged)
    judge_downstream: bool = True
    extra: dict = field(default_factory=dict)
    rerun: RerunSpec = field(default_factory=RerunSpec)

    _PARTS = {"settings": RunSettings, "axes": Axes, "rerun": RerunSpec}
    # manifest.json as before these axes and the recipe (the default recipe: the keys left out)
    _OMITTED = {"attentions": (), "paddings": (), "anchor": False, "pass_of": "", **RECIPE_OMITTED}
    _ABSENT = {"anchor": False}  # left out: --no-anchor, or a run from before the anchor was the default
    _FILE_ORDER = ("model", "degrees", "dtype", "device", "backward", "steps", "fixes", "fix_mode", "confirm",
                   "granularity", "out", "timeout", "seed", "batch_size", "seq_len", "variant", "baseline",
                   "op_include", "capture", "module_include", "extra", "tree_groups", "group_gemm", "selfcheck",
                   "oracle", "oracle_ops", "oracle_own", "micro_batches", "modes", "grid", "only", "positions",
                   "prefix_from", "flags", "layers", "judge_downstream", "attentions", "paddings", *RECIPE_OMITTED,
                   "anchor", "pass_of")

    def worlds(self):
        """Every configuration this compare runs, the reference first (tpdiag/base/points.py)."""
        from tpdiag.base.points import worlds

        a = self.axes
        out = worlds(a.degrees, a.micro_batches, a.modes, a.grid, degree_labels, attentions=a.attentions,
                     paddings=a.paddings, flags=self.flags, fix="+".join(self.fixes) or "none")
        if self.rerun.only:
            out = [out[0]] + [w for w in out[1:] if w.label in self.rerun.only]
        return out

    def world(self, point: Config, label: str, out_dir: str, device: str, ref_dir: str = "",
              reference: bool = False) -> WorldConfig:
        """The world of one configuration point. Decode has no backward (an engine's token-by-token
        logprobs): its worlds run forward only whatever --backward says. The float64 oracle runs
        in the reference world only."""
        r = self.rerun
        keep = reference and (r.oracle or r.oracle_ops)
        rerun = replace(r, only=(), **({} if keep else dict(oracle=(), oracle_ops=False, oracle_own=())))
        settings = replace(self.settings, device=device, backward=self.backward and point.mode != "decode")
        return WorldConfig(settings=settings, point=point, label=label, out_dir=out_dir, ref_dir=ref_dir,
                           rerun=rerun)._synced()
