"""The run configurations (tpdiag/config.py, issue 62 item 4): one nested configuration - the user's
settings, the configuration point (or the axes of a compare), the rerun spec that only tpdiag's own
passes set - written flat to the run directory, with the keys and order manifest.json's and
world.json's `config` have always had, and read back (the flat form, also an older tpdiag's).
Serialised generically: a field added to a part round-trips with nothing else touched."""
from __future__ import annotations

import json
from dataclasses import dataclass, fields

import pytest

# the run directory contract (DESIGN.md): the keys, in order, of manifest.json's and world.json's config
MANIFEST_KEYS = ["model", "degrees", "dtype", "device", "backward", "steps", "fixes", "fix_mode", "confirm",
                 "granularity", "out", "timeout", "seed", "batch_size", "seq_len", "variant", "baseline",
                 "op_include", "capture", "module_include", "extra", "tree_groups", "group_gemm", "selfcheck",
                 "oracle", "oracle_ops", "oracle_own", "micro_batches", "modes", "grid", "only", "positions",
                 "prefix_from", "flags", "layers", "judge_downstream", "attentions"]
WORLD_KEYS = ["model", "degree", "label", "out_dir", "dtype", "device", "backward", "steps", "seed",
              "batch_size", "seq_len", "lr", "clip_norm", "fixes", "granularity", "variant", "probes",
              "selfcheck", "op_include", "capture", "module_include", "ref_dir", "tree_groups", "group_gemm",
              "oracle", "oracle_ops", "oracle_own", "micro_batch", "mode", "positions", "prefix_from", "flags",
              "layers"]


def _through_json(d: dict) -> dict:
    return json.loads(json.dumps(d))


def _rerun_cfg():
    from tpdiag.config import CompareConfig

    return CompareConfig.of(degrees=(1, 2), fixes=("invariant-gemm",), oracle=("layers.0",), only=("2",),
                            oracle_own=(("2", "own-inputs-tp2.safetensors"),), micro_batches=(4, 2),
                            modes=("prefill", "decode"), attentions=("math",), op_include=("layers.0",))


def test_every_field_round_trips_flat():
    from tpdiag.config import CompareConfig, WorldConfig

    cfg = _rerun_cfg()
    d = cfg.to_dict()
    # paddings () left out, as before the axis; `anchor` (on by default) written when true
    assert list(d) == MANIFEST_KEYS + ["anchor"] and d["anchor"] is True
    assert d["oracle_own"] == [["2", "own-inputs-tp2.safetensors"]] and d["degrees"] == [1, 2]
    assert CompareConfig.from_dict(_through_json(d)) == cfg
    ref, other = cfg.worlds()[0], cfg.worlds()[1]
    w = cfg.world(ref.point, ref.label, "out/tp1", "cpu", reference=True)
    assert list(w.to_dict()) == WORLD_KEYS + ["attention", "anchor"]  # the attention axis' world, no 'only'
    plain = CompareConfig.of(degrees=(1, 2), anchor=False)
    assert list(plain.world(plain.worlds()[1].point, "2", "o", "cpu").to_dict()) == WORLD_KEYS  # as before the axis
    assert WorldConfig.from_dict(_through_json(w.to_dict())) == w
    assert w.rerun.oracle_own == cfg.rerun.oracle_own and w.rerun.only == ()
    # the float64 oracle is the reference world's only
    w2 = cfg.world(other.point, other.label, "out/tp2", "cpu")
    assert w2.rerun.oracle == () and w2.rerun.oracle_own == () and w2.degree == 2


def test_parts_are_separate():
    """The user's settings, the axes or point, and the rerun spec are separate parts; the rerun
    spec's fields are not read as the user's config's (cfg.oracle is an error, cfg.rerun.oracle)."""
    from tpdiag.base.configs import Config
    from tpdiag.config import Axes, CompareConfig, RerunSpec, RunSettings

    cfg = _rerun_cfg()
    assert isinstance(cfg.settings, RunSettings) and isinstance(cfg.axes, Axes) and isinstance(cfg.rerun, RerunSpec)
    assert cfg.rerun.only == ("2",) and cfg.settings.fixes == ("invariant-gemm",) == cfg.fixes
    assert CompareConfig.of(degrees=(1, 2)).rerun == RerunSpec()  # a user's run: no rerun fields
    with pytest.raises(AttributeError, match="rerun"):
        cfg.oracle
    w = cfg.world(cfg.worlds()[0].point, "1", "o", "cpu")
    assert isinstance(w.point, Config) and w.point.fix == "invariant-gemm" and w.settings.device == "cpu"
    # the world's point follows its settings' fix and flags, however it was made
    assert w.with_(fixes=("all",), flags="default").point.with_(repeat="") == w.point.with_(fix="all", flags="default")
    with pytest.raises(TypeError, match="no setting"):
        cfg.with_(nonsense=1)


def test_an_older_flat_config_loads():
    """A manifest written before attentions/paddings existed (and with every key flat) loads; a key
    of a newer tpdiag is refused (bad input: one line, exit 2)."""
    from tpdiag.config import CompareConfig
    from tpdiag.errors import BadInput

    d = _through_json(_rerun_cfg().with_(attentions=()).to_dict())
    assert "attentions" not in d
    back = CompareConfig.from_dict(d)
    assert back.attentions == () and back.rerun.oracle == ("layers.0",)
    with pytest.raises(BadInput, match="from_the_future"):
        CompareConfig.from_dict({**d, "from_the_future": 1})


def test_the_anchor_is_the_default_and_a_file_without_it_ran_drifted():
    """Re-anchored later steps are the default (runner/anchor.py); `anchor` is written when true and left
    out under --no-anchor - as every run before the default changed left it out, having trained each
    side on its own. A file without the key reads back false (a worker reads its world.json config so:
    read as today's default, a --no-anchor world would load the reference's state anyway)."""
    from tpdiag.config import CompareConfig, RunSettings, WorldConfig

    assert RunSettings().anchor is True and CompareConfig.of(degrees=(1, 2)).anchor is True
    on, off = CompareConfig.of(degrees=(1, 2), steps=3), CompareConfig.of(degrees=(1, 2), steps=3, anchor=False)
    assert on.to_dict()["anchor"] is True and "anchor" not in off.to_dict()
    assert CompareConfig.from_dict(_through_json(off.to_dict())).anchor is False
    assert CompareConfig.from_dict(_through_json(on.to_dict())).anchor is True
    for cfg, want in ((on, True), (off, False)):
        w = cfg.world(cfg.worlds()[1].point, "2", "o", "cpu")
        assert WorldConfig.from_dict(_through_json(w.to_dict())).anchor is want


def test_a_field_added_to_a_part_needs_no_code():
    """A field no code names (a tuple of pairs, as oracle_own), added to the rerun spec, is written
    flat (after the files' keys) and read back into its part; the same dict passed straight to the
    part's dataclass (what a hand-kept list misses) does not give it back."""
    from dataclasses import make_dataclass

    import tpdiag.config as C

    Spec = make_dataclass("Spec", [(f.name, f.type, f) for f in fields(C.RerunSpec)] + [("later", tuple, ())],
                          frozen=True)

    @dataclass(frozen=True)
    class Cfg(C.CompareConfig):
        rerun: Spec = Spec()  # type: ignore[valid-type]
        _PARTS = {**C.CompareConfig._PARTS, "rerun": Spec}

    cfg = Cfg.of(degrees=(1, 2), later=(("1", "x"), ("2", "y")), oracle=("layers.0",))
    d = _through_json(cfg.to_dict())
    assert list(d)[-1] == "later" and d["later"] == [["1", "x"], ["2", "y"]]
    assert Cfg.from_dict(d) == cfg and Cfg.from_dict(d).rerun.later == (("1", "x"), ("2", "y"))
    # negative control: lists are not the frozen tuples
    assert Spec(**{f.name: d[f.name] for f in fields(Spec) if f.name in d}) != cfg.rerun  # pass_of: left out
