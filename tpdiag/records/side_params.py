"""Where the parameters a step's forward read are recorded: the init for step 0, else the step
before's update (diff/equal_inputs._index reads the same). The own-input pass ships this side's
values under these keys (diff/own_params.py) and the reference world re-executes a module from them
(probes/own_params.py): from step 1 on the two sides' parameters differ (the update's rounding at
TP > 1, a broken update's mistake), and the reference's module is then not this side's function."""
from __future__ import annotations

from tpdiag.records.keys import ROOT_MODULE, record_key


def source_key(step: int, owner: str, short: str) -> str:
    """The record of parameter `short` of the module recorded as `owner` that step `step`'s forward read."""
    owner = owner or ROOT_MODULE
    if int(step) == 0:
        return record_key(0, "init", owner, "param_init", 0, short)
    return record_key(int(step) - 1, "optimizer", owner, "param", 0, short)


def read_at(key_step: int, kind: str) -> int:
    """The step whose forward read a parameter record (param_init: 0; param at s: s + 1)."""
    return 0 if kind == "param_init" else int(key_step) + 1
