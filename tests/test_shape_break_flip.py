"""A record the ranks hold part of AFTER a record that differed is not judged a sharding bug
(diff/shape_break.py), helper hred20.

tests/models/planted/moe_expert_calls.py:calls_ok is a correct replicated MoE whose expert modules are
called on the tokens routed to them. At TP=2 the row-parallel MLP before it rounds otherwise, the near-tie
router flips expert 3's only token to expert 6, and `moe.experts.3` is called on 0 tokens where TP=1
called it on 1: the ranks hold 0 of its 32 elements. Main named that `sharding-bug` (gate exit 4) - a
shape the router's values decided, after a rounding difference, read as a plan's mistake. Now: `unknown`,
saying why, and the gate fails it (exit 1) whatever `--allow rounding` says; an edited summary that
relabels it, or calls it a break with nothing before it, is refused (exit 2). A break with nothing before it differing still reads
`sharding-bug` (tests/test_user_tt_team.py, test_tt_sp_compare.py)."""
import json

from conftest import run_cli

SPEC = "py:tests/models/planted/moe_expert_calls.py:calls_ok"
KEY = "s0/forward/moe.experts.3/in#0/0"


def _gate(d, *more):
    return run_cli("gate", str(d), *more).returncode


def test_a_shape_a_router_flip_changed_is_unknown_not_a_sharding_bug(tmp_path):
    d = tmp_path / "ok"
    p = run_cli("compare", "--model", SPEC, "--tp", "1,2", "--dtype", "bfloat16", "--no-baseline",
                "--no-confirm", "--forward-only", "--out", str(d), env={"OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-3000:] + p.stdout[-2000:]
    s = json.loads((d / "summary.json").read_text())
    e = s["degrees"]["2"]
    assert e["shape_break"]["key"] == KEY, e["shape_break"]
    # the first record that differed before it: the row-parallel down's output (rounding)
    assert e["shape_break"]["after"] == "s0/forward/down/out#0/0", e["shape_break"]
    assert e["first_divergence"]["cause"] == "row-parallel-reduction", e["first_divergence"]
    f = next(f for f in e["findings"] if f["key"] == KEY)
    assert f["cause"] == "unknown" and "the 2 ranks hold 0 of its 32 elements" in f["why"], f
    assert "a record before it differed already (s0/forward/down/out#0/0)" in f["why"], f["why"]
    assert not any(g["cause"] == "sharding-bug" for g in e["findings"]), e["findings"]
    assert s["class"] == "unknown" and "BUG" not in p.stdout, p.stdout[-2000:]
    assert _gate(d, "--allow", "rounding") == 1

    def edited(name, edit, relabel_class=True):
        s2 = json.loads((d / "summary.json").read_text())
        edit(s2["degrees"]["2"])
        if relabel_class:
            s2["class"] = s2["degrees"]["2"]["class"] = "rounding"
        (d / "summary.json").write_text(json.dumps(s2))
        try:
            return _gate(d, "--allow", "rounding")
        finally:
            (d / "summary.json").write_text(json.dumps(s))

    def relabel(e):
        for g in e["findings"]:
            g["cause"] = "row-parallel-reduction"

    def drop_after(e):  # said as a break with nothing before it, its finding a sharding-bug
        e["shape_break"]["after"] = None
        next(g for g in e["findings"] if g["key"] == KEY)["cause"] = "sharding-bug"

    def drop_flag(e):  # the finding no longer flagged as the break: judged as any finding beside diff.csv
        del next(g for g in e["findings"] if g["key"] == KEY)["shape_break"]

    assert edited("relabel", relabel) == 2
    assert edited("drop_after", drop_after) == 2
    # passed `--allow rounding` (exit 0) before hreview20: the `unknown` was read as a rounding-class finding
    # (its class left `unknown`, as compare wrote it)
    assert edited("drop_flag", drop_flag, relabel_class=False) == 2
