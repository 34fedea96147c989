"""Typed errors. The library raises these; only the CLI turns them into messages and exit codes."""
from __future__ import annotations


class TpdiagError(Exception):
    """Base class. `exit_code` follows DESIGN.md: 2 bad input / inconclusive, 3 environment."""

    exit_code = 2

    def __init__(self, *args, lines: bool = False):
        super().__init__(*args)
        # lines=True: the message is one problem per line (a rollout file's bad lines), each printed
        self.lines = lines


class BadInput(TpdiagError):
    """A value the user gave cannot be used (a spec, a degree list, a dtype, a path)."""

    exit_code = 2


class BadType(BadInput, TypeError):
    """A value of the wrong type (a str where an int belongs): a BadInput, and a TypeError."""


class UnguardedMain(BadInput):
    """A script that starts tpdiag's worlds with its call at top level, outside `if __name__ ==
    '__main__':` - every rank, importing the script again as it starts, called tpdiag again."""


class NotCarried(UserWarning):
    """tpdiag.accumulate_grads: parameters whose grads went into .grad per piece, not into the
    fp32 carry - their grads are not bitwise across micro-batch sizes."""


class Inconclusive(TpdiagError):
    """The evidence is incomplete or corrupt: a world failed, a record is missing or edited."""

    exit_code = 2


class NotComparable(Inconclusive):
    """Two captures that cannot be compared (different model, shapes, seeds, dtypes)."""


class ShortOfWhole(NotComparable):
    """A record the ranks together hold fewer elements of than the reference's (records/layout.py):
    no layout gathers it, and no rounding changes a shape - the plan computed part of what the
    reference computed there (diff/shape_break.py names it where it is the first such record)."""


class MalformedKey(Inconclusive):
    """A record key that is not `s{step}/{phase}/{module}/{kind}#{call}[/{name}]` (records/keys.py)."""


class UnsupportedLayout(Inconclusive):
    """A DTensor placement tpdiag does not know how to gather into the whole tensor."""


class EnvironmentProblem(TpdiagError):
    """A backend or device that is not available here."""

    exit_code = 3
