"""A record in words, as the verdict lines name it: its phase and module, its step, and where a
wrong input or grad was computed."""
from __future__ import annotations

from tpdiag.records.keys import ROOTS


def where(fd: dict, at_bug: bool = False) -> str:
    """A record in words: 'forward: layers.0.attention.wo', 'loss: logprobs', 'backward: output (grad_out 0)';
    a record of a later step says which ('step 1 backward: mlp (param_grad gain)'): under --steps N a
    mistake that only step 1 shows read as if step 0 held it. `at_bug`: a bug's op where its caller's
    code goes wrong (`bug_op`, diff/first_op._first_far_op) in place of the first op that differs."""
    step = fd.get("step")
    bug = fd.get("bug_op") if at_bug and fd.get("cause") == "sharding-bug" else None
    if bug:
        fd = {**fd, "op": bug["op"], "op_at": bug.get("at")}
    text = _where(fd)
    return f"step {step} {text}" if isinstance(step, int) and step > 0 else text


def _where(fd: dict) -> str:
    phase, module, kind, name = fd.get("phase"), fd.get("module"), fd.get("kind"), fd.get("name")
    if module == "model" and phase == "loss" and kind == "loss":
        return "loss: the loss function (Target.loss or the built-in cross-entropy)"
    if kind == "buffer" and not fd.get("op"):
        # kept state (not a parameter) that the step's own code wrote: read by the next step
        return f"{phase}: {module} (buffer {name}, written during the step)"
    if module in ROOTS and kind in ("param_init", "param_grad", "param") and name and not fd.get("op"):
        # a parameter of the root module itself (a tied weight the model holds directly; an HF
        # CausalLM's own, recorded as "(root)" beside its `model` child)
        return f"{phase}: {name} ({kind}; a parameter of the root module)"
    if module == "model" and kind not in ("in", "out", "grad_out") and not fd.get("op"):
        # whole-model records (logprobs, loss, grad norm) have no module of their own
        text = f"{phase}: {name if name == kind or not kind else f'{kind} {name}'}"
    elif kind == "in" and not fd.get("op") and fd.get("key") and _record_module(fd["key"]) != module:
        # a first divergence at an input is filed under its caller (`module`), whose code computed it;
        # "model (in 0)" read as the model's own input (the tokens, bitwise equal): name whose input
        text = f"{phase}: {_record_module(fd['key'])} ({kind} {name}), computed in {module}'s own forward code"
    else:
        # an input's op ran in its caller's own code (a finding keeps the record's module, `made_in` the caller)
        at = fd.get("made_in") if kind == "in" and fd.get("op") and fd.get("made_in") else module
        text = f"{phase}: {at}" + (f" :: {fd['op']}" if fd.get("op") else "")
        if fd.get("op") and fd.get("op_at"):
            text += f" (at {fd['op_at']})"  # which of the module's ops: its line in the user's code
        # with an op named, the wrong value is that op's output; the record's kind and name
        # (`in 0` of the next module, where the module pass first saw it) would point elsewhere
        if kind not in ("out", None) and not fd.get("op"):
            text += f" ({kind})" if name in (kind, None, "") else f" ({kind} {name})"
        text += made_by(fd)
    return text


def _record_module(key: str) -> str:
    from tpdiag.records.keys import RecordKey

    return RecordKey.parse(key).module


def _chain_at(fd: dict) -> str:
    """A fix chain round's first divergence (phase, module, kind: no record name is kept) as the
    table names records: 'loss: logprobs', 'backward: norm (param_grad)' - it read 'at model' and
    'at norm', which said neither the record nor the phase."""
    phase, module, kind = fd.get("phase"), fd.get("module"), fd.get("kind")
    if module == "model" and kind and kind not in ("in", "out", "grad_out"):
        return f"{phase}: {kind}"
    return f"{phase}: {module}" + (f" ({kind})" if kind and kind != "out" else "")


def made_by(fd: dict) -> str:
    """Where a wrong input or grad was computed: the grad at a module's output is what the modules
    that read it returned (a missing or doubled all-reduce in a consumer's backward is fixed
    there); an input that differs first is computed in its caller's own code."""
    if fd.get("op"):
        return ""
    if fd.get("kind") == "grad_out" and fd.get("consumers"):
        return f", returned by the backward of {', '.join(fd['consumers'])}"
    if fd.get("kind") == "in" and fd.get("made_in"):
        return f", computed in {fd['made_in']}'s own forward code"
    return ""

