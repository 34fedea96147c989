"""What `tpdiag gate` found: each record beyond policy (Violation), each degree's result and the
run's (GateResult: status, exit code, the lines the CLI prints, the JSON). gate/verdict.py
builds them from a run directory."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from tpdiag.base.points import config_name
from tpdiag.gate.policy import Policy


@dataclass
class Violation:
    degree: str
    phase: str
    module: str
    op: str | None
    kind: str
    name: str
    cause: str
    max_ulp: int | None
    max_abs: float | None
    reason: str
    key: str = ""
    beyond: float | None = None  # how far beyond rounding (its bound, or the float64 threshold)
    follow: int = 0              # divergent records that follow from this one (grouped under it)
    round: int = 0               # the fix chain's round (--fix auto) whose run holds the record
    fixes: tuple = ()            # ... and the fixes that round ran with
    op_at: str = ""              # the op's line in the user's code ('model.py:63 in forward')

    @property
    def unit(self) -> str:
        """What diverged, in the run's terms: an op on op-granularity runs, else a module."""
        return "op" if self.op else "module"

    def line(self) -> str:
        ulp = "-" if self.max_ulp is None else str(self.max_ulp)
        mabs = "-" if self.max_abs is None else f"{self.max_abs:.3g}"
        # module-granularity records name no op; an op named is where the difference entered,
        # the numbers are the record's
        op = (f" (the difference enters at op {self.op}" + (f" at {self.op_at}" if self.op_at else "") + ")"
              if self.op else "")
        far = f"; {self.beyond:.3g}x beyond rounding" if self.beyond and self.beyond > 1 else ""
        more = (f"; and {_count(self.follow, 'record')} that follow from it (not listed)"
                if self.follow else "")
        # the loss phase's records are the loss function's (Target.loss), not a module's
        what = "the loss function" if self.phase == "loss" and self.module == "model" else f"module {self.module}"
        rnd = (f" (fix chain round {self.round}, with {', '.join(self.fixes) or 'no fix'})"
               if self.round else "")
        return (f"{config_name(self.degree)}{rnd}: {what}{op}, phase {self.phase}, record "
                f"{self.kind} {self.name}{self._of()}, cause {self.cause} (max ULP {ulp}, max abs vs the reference "
                f"{mabs}{far}): {self.reason}{more}")


    def _of(self) -> str:
        """' of M' where the record is another module's than the one named (an input that differs
        first is filed under its caller): 'module attention ..., record in 0' read as the
        attention's own input, bitwise equal, where the record was attention.wo's."""
        if not self.key:
            return ""
        from tpdiag.records.keys import MalformedKey, RecordKey

        try:
            rec = RecordKey.parse(self.key).module
        except MalformedKey:  # a key of another form: named as before
            return ""
        return f" of {rec}" if rec != self.module else ""


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


@dataclass
class DegreeResult:
    label: str
    status: str            # pass | fail | error | skipped
    checked: int = 0       # divergent records judged against the policy
    violations: list[Violation] = field(default_factory=list)
    error: str | None = None
    ungated: int = 0       # divergent records in phases the policy does not gate


@dataclass
class GateResult:
    run_dir: str
    policy: Policy
    reference: str | None = None
    degrees: dict[str, DegreeResult] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)  # evidence problems: exit 2

    @property
    def status(self) -> str:
        if self.problems:
            return "inconclusive"
        return "fail" if any(d.violations for d in self.degrees.values()) else "pass"

    @property
    def bug(self) -> bool:
        """A bug-class or non-finite record is beyond policy: exit EXIT_BUG, not 1."""
        from tpdiag.records.causes import cause_class

        return any(cause_class(v.cause) in ("bug", "non-finite") for d in self.degrees.values() for v in d.violations)

    @property
    def exit_code(self) -> int:
        from tpdiag.records.causes import EXIT_BUG

        if self.status == "fail" and self.bug:
            return EXIT_BUG
        return {"pass": 0, "fail": 1, "inconclusive": 2}[self.status]

    @property
    def first_violation(self) -> Violation | None:
        """The headline's: the first bug-class (or non-finite) violation where there is one - not
        a harmless record before it - else the first."""
        from tpdiag.records.causes import cause_class

        every = [v for d in self.degrees.values() for v in d.violations]
        return next((v for v in every if cause_class(v.cause) in ("bug", "non-finite")),
                    every[0] if every else None)

    def lines(self) -> list[str]:
        # Each violation is printed once: the first in the headline, the others under their degree.
        first = self.first_violation
        from tpdiag.records.causes import cause_class

        # a NaN/Inf at one side is its own class (exit 4 too), not a wrong result: say which
        lead = (("NaN or Inf (NON-FINITE)" if cause_class(first.cause if first else None) == "non-finite" else "a BUG")
                if self.bug else "first divergent " + (first.unit if first else "record"))
        head = {"pass": "PASS - nothing diverges beyond policy",
                "fail": (f"FAIL - {lead} "
                         f"beyond policy: {first.line() if first else ''}"),
                "inconclusive": f"INCONCLUSIVE - {self.problems[0] if self.problems else ''}"}[self.status]
        # compare may just have said "rounding only, nothing is wrong": the one option that
        # lets that through is named first
        how = ("--allow rounding lets rounding-class causes through; causes or per-module budgets with "
               "--policy FILE.toml" if self.policy.source == Policy.source else "format")
        out = [f"gate: {head}", f"policy: {self.policy.source} ({how}: docs/ci.md, 'The policy file')"]
        out += [f"warning: {w}" for w in self.policy.warnings]
        out += [f"evidence: {p}" for p in self.problems[1:]]
        for d in self.degrees.values():
            what = {"pass": _pass_words(d),
                    "skipped": "not gated by the policy", "error": f"error: {d.error}",
                    "fail": f"fail ({_count(len(d.violations), 'record')} beyond policy"
                            + ("; the first is in the headline)" if first in d.violations else ")")}[d.status]
            out.append(f"{config_name(d.label)}: {what}")
            out += [f"  {v.line()}" for v in [v for v in d.violations if v is not first][:5]]
        return out

    def to_dict(self) -> dict:
        from tpdiag.base.files import json_safe

        # json_safe: an Inf/NaN max_abs must not become a bare Infinity token in --format json.
        return json_safe({
            "status": self.status, "exit_code": self.exit_code, "run_dir": self.run_dir,
            "reference": self.reference, "policy": asdict(self.policy), "problems": self.problems,
            "first_violation": asdict(self.first_violation) if self.first_violation else None,
            "degrees": {k: asdict(v) for k, v in self.degrees.items()}})


def _pass_words(d: DegreeResult) -> str:
    # "bitwise" only where no record differs at all: a degree whose divergent records sit in phases the
    # policy does not gate passed the policy, it was not bitwise.
    if not d.checked and not d.ungated:
        return "pass (bitwise)"
    parts = [f"{_count(d.checked, 'divergent record')} within policy"] if d.checked else []
    parts += [f"{_count(d.ungated, 'divergent record')} in phases the policy does not gate"] if d.ungated else []
    return f"pass ({'; '.join(parts)})"
