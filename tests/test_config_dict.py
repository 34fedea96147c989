"""The run configurations serialise generically (tpdiag/config.py to_dict / from_dict, issue 62
item 4): every field, in order, tuples as lists and back, with no per-field list to keep up - a
field added to a config round-trips through JSON with nothing else touched."""
from __future__ import annotations

import json
from dataclasses import dataclass, fields


def _through_json(d: dict) -> dict:
    return json.loads(json.dumps(d))


def test_every_field_round_trips():
    from tpdiag.config import CompareConfig

    cfg = CompareConfig(degrees=(1, 2), fixes=("invariant-gemm",), oracle=("layers.0",), only=("2",),
                        oracle_own=(("2", "own-inputs-tp2.safetensors"),), micro_batches=(4, 2),
                        modes=("prefill", "decode"), attentions=("math",), op_include=("layers.0",))
    d = cfg.to_dict()
    assert list(d) == [f.name for f in fields(CompareConfig) if f.name != "paddings"]  # () left out, as before
    assert d["oracle_own"] == [["2", "own-inputs-tp2.safetensors"]] and d["degrees"] == [1, 2]
    assert CompareConfig.from_dict(_through_json(d)) == cfg
    w = cfg.world(2, "2", "out/tp2", "cpu", mode="prefill").with_(oracle_own=cfg.oracle_own)
    assert "attention" not in w.to_dict()  # 'auto': world.json as before the axis existed
    assert type(w).from_dict(_through_json(w.to_dict())) == w


def test_a_new_field_needs_no_code():
    """A config with a field no code names (a tuple of pairs, as oracle_own) round-trips; the
    same dict passed straight to the dataclass (what a hand-kept list misses) does not."""
    from tpdiag.config import from_dict, to_dict

    @dataclass(frozen=True)
    class Later:
        a: int = 1
        pairs: tuple[tuple[str, str], ...] = ()

    x = Later(2, (("1", "x"), ("2", "y")))
    back = _through_json(to_dict(x, {}))
    assert back == {"a": 2, "pairs": [["1", "x"], ["2", "y"]]}
    assert from_dict(Later, back) == x
    assert Later(**back) != x  # negative control: lists are not the frozen tuples
    assert to_dict(Later(), {"pairs": ()}) == {"a": 1}
