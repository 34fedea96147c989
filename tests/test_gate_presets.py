"""`tpdiag gate --allow rounding`: a preset of every rounding-class cause (issue 57 item 5); the
exit codes on real planted runs are tests/test_behind.py's."""
import pytest

from tpdiag.errors import BadInput
from tpdiag.gate import Policy, with_allowed
from tpdiag.records.causes import CAUSES, cause_class


def test_rounding_preset_allows_exactly_the_rounding_class():
    p = with_allowed(Policy(), "rounding")
    assert set(p.allow_causes) == {c for c in CAUSES if cause_class(c) == "rounding"}
    for c in ("sharding-bug", "rank-inconsistent-replica", "non-finite", "unknown"):
        assert c not in p.allow_causes
    assert p.warnings == () and "--allow rounding" in p.source
    # adds to a policy file's causes
    q = with_allowed(Policy(allow_causes=("unknown",), source="p.toml"), "rounding")
    assert "unknown" in q.allow_causes and q.source == "p.toml + --allow rounding"
    assert with_allowed(Policy(), None) == Policy()


def test_bad_or_forbidden_names_are_one_line_errors():
    for bad in ("bogus", "rounding,nope", "non-finite", ","):
        with pytest.raises(BadInput):
            with_allowed(Policy(), bad)
    p = with_allowed(Policy(), "unknown")
    assert p.allow_causes == ("unknown",) and p.warnings
