"""The record key: what aligns one record across degrees, runs and files (events.jsonl, diff.csv,
summary.json, oracle notes), as `s{step}/{phase}/{module}/{kind}#{call}/{name}`.

Every module that builds or reads a key goes through RecordKey, so the format lives here only
and a key that does not parse is an error (MalformedKey), never a silent miss of a dict lookup.
An oracle note about a whole module call has no name: `s{step}/{phase}/{module}/oracle#{call}`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from tpdiag.errors import MalformedKey

# phase and module hold no '#', kind neither '/' nor '#': the first '#' ends kind, so a name
# may hold anything ('aten::cat#0.0', an op's call and output index)
_KEY = re.compile(r"s(?P<step>\d+)/(?P<phase>[^/#]+)/(?P<module>[^#]*)/(?P<kind>[^/#]+)#(?P<call>\d+)"
                  r"(?:/(?P<name>.*))?", re.S)


@dataclass(frozen=True)
class RecordKey:
    step: int
    phase: str
    module: str
    kind: str
    call: int = 0
    name: str | None = None  # None: a key of a whole module call (an oracle note)

    def format(self) -> str:
        return record_key(self.step, self.phase, self.module, self.kind, self.call, self.name)

    __str__ = format

    def prefix(self) -> str:
        """The key up to and with the '/' before the name: what every name of this call shares."""
        return f"s{self.step}/{self.phase}/{self.module}/{self.kind}#{self.call}/"

    @classmethod
    def of(cls, meta: dict) -> RecordKey:
        """The key of an event or diff row (a dict with step, phase, module, kind, call, name)."""
        return cls(int(meta["step"]), meta["phase"], meta["module"], meta["kind"], int(meta["call"]),
                   None if meta.get("name") is None else str(meta["name"]))

    @classmethod
    def parse(cls, key: str) -> RecordKey:
        m = _KEY.fullmatch(key) if isinstance(key, str) else None
        if m is None:
            raise MalformedKey(f"record key {key!r}: expected s{{step}}/{{phase}}/{{module}}/{{kind}}#{{call}}"
                               "[/{name}]")
        d = m.groupdict()
        return cls(int(d["step"]), d["phase"], d["module"], d["kind"], int(d["call"]), d["name"])


def record_key(step, phase: str, module: str, kind: str, call=0, name=None) -> str:
    """RecordKey(...).format() without the object: the recorder calls it once per record, on the
    host time a small step pays per record (docs/benchmarks.md, "Probe cost in hash mode")."""
    head = f"s{step}/{phase}/{module}/{kind}#{call}"
    return head if name is None else f"{head}/{name}"


# The name suffix of an oracle record holding [||o||, ||y - o||] (float64) instead of the float64
# value o itself (probes/oracle_hooks.py writes it, diff/oracle.judge_own reads it).
ORACLE_NORMS = "~norms"
# the name prefix of an oracle record holding a child's output grad in its parent's float64 backward
# (probes/oracle_hooks.tap_name: grad_out.O.cJ.pP; diff/engine.py reads it)
ORACLE_TAP = "grad_out."
# the kind of a capture's float64 re-execution of a user's own optimizer step (probes/optim_shadow.py):
# each side's own value, judged with its parameter (diff/optim_own.py), never compared across sides
OPT_F64 = "opt_f64"
# the root module's record name, and the model-level records' (batch, logits, loss, grad_norm)
ROOT_MODULE = "model"
# the root's record name where a top-level child is named "model" (HF's LlamaForCausalLM.model, a
# LlamaModel): that child keeps "model", the prefix of its descendants' names (model.embed_tokens),
# and the root's own module records (forward in/out, backward grad_out, oracle) take this one. Both
# were "model" before RECORD_FORMAT 3: the root's and the child's calls were counted as one module's
# two, so the child's float64 backward never judged the grads its code reads (the embeddings'
# output grad stayed "not judged" on every hf: model). Not a Python attribute name: no child has it.
ROOT_NAMESAKE = "(root)"
ROOTS = (ROOT_MODULE, ROOT_NAMESAKE)


def root_record_name(child_names) -> str:
    """The root module's record name, given its direct children's names (named_children)."""
    return ROOT_NAMESAKE if ROOT_MODULE in set(child_names) else ROOT_MODULE


def root_of(modules) -> str:
    """The root's record name among a run's recorded module names: ROOT_NAMESAKE where it is one
    of them (then "model" is the root's child of that name), else ROOT_MODULE."""
    return ROOT_NAMESAKE if ROOT_NAMESAKE in modules else ROOT_MODULE


def param_name(module: str, short: str) -> str:
    """A parameter's name in the model from its record's module and short name: "out_scale" for the
    root's own (either of ROOTS: "model" is the root in a model with no child of that name), else
    "mlp.up.weight". Words only, never a lookup."""
    return short if module in ROOTS else f"{module}.{short}"


def sole_consumer(consumers) -> str | None:
    """The one module whose backward computed a grad_out record: the modules that read that output,
    less those inside another of them. A parent that hands its input straight to a child (Megatron's
    column layer called first in its MLP) lists both, and the outer one's backward computes the
    whole grad, its child's share included; None where unrelated modules read it."""
    cs = set(consumers or ())
    outer = {c for c in cs if not any(c.startswith(o + ".") for o in cs)}
    return next(iter(outer)) if len(outer) == 1 else None
