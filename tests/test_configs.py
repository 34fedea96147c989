"""One configuration type, one name (issue 56 item 8): compare's worlds and rollout's
configurations are tpdiag.base.configs.Config, named by one scheme that gives today's names for
today's runs, parsed back exactly; the run directory's folders, summary.json, the report and
tpdiag.load() use it; compare's --attention axis runs what it names."""
import importlib.util
import json
import os

import pytest

from tests.conftest import run_cli
from tpdiag.base import configs
from tpdiag.base.configs import Config
from tpdiag.errors import BadInput

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_today_names_are_what_they_were():
    """The names the run directory contract and earlier runs hold: compare's degree keys and
    axis keys, rollout's configuration labels."""
    from tpdiag.base.points import worlds
    from tpdiag.config import degree_labels

    ws = worlds((1, 2, 1), (4, 2), ("prefill", "decode"), True, degree_labels)
    assert [w.label for w in ws] == ["1", "2", "1-2", "1-decode", "1-mb2", "1-mb2-decode",
                                     "2-decode", "2-mb2", "2-mb2-decode"]
    assert [w.axis for w in ws] == ["", "tp", "tp", "mode", "micro_batch", "micro_batch+mode", "tp+mode",
                                    "tp+micro_batch", "tp+micro_batch+mode"]
    assert [configs.folder(w.label) for w in ws[:5]] == ["tp1", "tp2", "tp1-2", "tp1-decode", "tp1-mb2"]
    assert Config(1, 4, "prefill", "none").rollout_name() == "tp1-mb4-prefill-none"
    assert Config(2, 1, "decode", "all", "deterministic", "sdpa-math", "left").rollout_name() == \
        "tp2-mb1-decode-all-deterministic-sdpa-math-padleft"
    assert Config(1, 8, "decode", "none", attention="eager").rollout_name() == "tp1-mb8-decode-none-eager"


@pytest.mark.parametrize("cfg", [
    Config(1, 4, "prefill", "none"),
    Config(2, 1, "decode", "tp-invariant-linear+invariant-gemm", "deterministic", "sdpa-flash", "right"),
    Config(4, 8, "prefill", "all", "default", "eager", "left"),
    Config(1, 2, "decode", "invariant-attention", "deterministic", "sdpa", "auto"),
    Config(8, 1, "prefill", "deterministic-collectives", "default", "sdpa-cudnn", "left"),
])
def test_every_name_parses_back_to_its_configuration(cfg):
    """Round trip of every spelling: the whole name, rollout's, and compare's key against a
    reference (the axes it leaves out are the reference's) - fix names and SDPA backends hold '-'."""
    assert configs.parse(cfg.name()) == cfg
    assert configs.parse(cfg.rollout_name()) == cfg
    for ref in (Config(1), Config(cfg.tp, cfg.micro_batch), Config(1, 4, "prefill", cfg.fix, cfg.flags)):
        key = cfg.compare_key(ref)
        assert configs.parse(key, ref) == cfg, key
        assert configs.parse(configs.folder(key), ref) == cfg
    again = cfg.with_(repeat="2")
    assert configs.parse(again.compare_key(cfg), cfg) == again
    assert again.compare_key(cfg) == f"{cfg.tp}-2"


@pytest.mark.parametrize("text", ["", "x", "tp", "tpx-mb2", "1-mb2-bad fix", "tp1-prefill-a+"])
def test_a_name_that_is_not_one_is_refused(text):
    with pytest.raises(BadInput, match="configuration"):
        configs.parse(text)


def _engine():
    spec = importlib.util.spec_from_file_location("tpdiag_example_hf_rollout_cfg",
                                                  os.path.join(ROOT, "examples", "hf_rollout.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def hf_runs(tmp_path_factory):
    """A tiny hf: llama with its generate() rollout; a compare and a rollout of it, each on the
    attention axis sdpa-math,sdpa-flash."""
    pytest.importorskip("transformers")
    d = tmp_path_factory.mktemp("cfgnames")
    files = _engine().write_all(str(d), n=2, new_tokens=3, top_k=4)
    out = d / "run"
    r = run_cli("compare", "--model", "hf:" + files["model"], "--tp", "1", "--attention", "sdpa-math,sdpa-flash",
                "--batch-size", "2", "--seq-len", "8", "--forward-only", "--no-confirm", "--no-baseline",
                "--out", str(out), "--format", "json")
    assert r.returncode in (0, 1), r.stderr
    from tpdiag.rollout.run import RolloutConfig, run_rollout

    ro = run_rollout(RolloutConfig(file=files["jsonl"], model="hf:" + files["model"], micro_batch=(2,),
                                   modes=("prefill",), fixes=("none",), attention=("sdpa-math", "sdpa-flash")))
    return str(out), ro


def test_compare_and_rollout_name_a_configuration_alike(hf_runs):
    from tpdiag.records.paths import RunDir

    out, ro = hf_runs
    with open(RunDir(out).summary) as f:
        s = json.load(f)
    with open(RunDir(out).manifest) as f:
        m = json.load(f)
    assert s["reference_config"] == {"tp": 1, "micro_batch": 0, "mode": "prefill", "attention": "sdpa-math"}
    assert set(s["configurations"]) == {"1-sdpa-flash"}
    assert s["configurations"]["1-sdpa-flash"]["axis"] == "attention"
    assert s["configurations"]["1-sdpa-flash"]["config"]["attention"] == "sdpa-flash"
    assert os.path.isdir(RunDir(out).world("1-sdpa-flash")) and RunDir.folder("1-sdpa-flash") == "tp1-sdpa-flash"
    assert set(ro["configurations"]) == {"tp1-mb2-prefill-none-sdpa-math", "tp1-mb2-prefill-none-sdpa-flash"}
    # the same configuration, spelled by each command's choice of axes, parses to the same point
    ref = configs.parse(s["reference_label"], Config(1, 0, "prefill", "none", "deterministic", "sdpa-math"))
    c = configs.parse("1-sdpa-flash", ref)
    r = configs.parse("tp1-mb2-prefill-none-sdpa-flash")
    assert (c.tp, c.mode, c.attention) == (r.tp, r.mode, r.attention) == (1, "prefill", "sdpa-flash")
    assert r.with_(micro_batch=0, flags="deterministic").compare_name(ref) == "tp1-sdpa-flash"
    # each ran the backend its name says, in compare's manifest as in rollout's summary (the
    # reference's math is the negative control of the switch: without it SDPA runs flash on the CPU)
    ran = {lab: w["numerics"]["sdpa_ran"] for lab, w in m["worlds"].items()}
    assert set(ran["1"]) == {"math (cpu)"} and set(ran["1-sdpa-flash"]) == {"flash (cpu)"}, ran
    assert set(ro["configurations"]["tp1-mb2-prefill-none-sdpa-math"]["sdpa_ran"]) == {"math (cpu)"}
    assert set(ro["configurations"]["tp1-mb2-prefill-none-sdpa-flash"]["sdpa_ran"]) == {"flash (cpu)"}
    assert "SDPA backend that ran: math (cpu) in tp1; flash (cpu) in tp1-sdpa-flash" in s["flags"]["line"]
    if s["status"] == "divergent":  # the kernels' own orders: rounding, named as the attention's
        assert s["configurations"]["1-sdpa-flash"]["first_divergence"]["cause"] == "attention-kernel"


def test_load_frames_carry_the_configuration_columns(hf_runs):
    import tpdiag

    out, _ = hf_runs
    run = tpdiag.load(out)
    row = run.degrees.set_index("degree").loc["1-sdpa-flash"]
    assert (row["configuration"], row["axis"], row["tp"], row["micro_batch"], row["mode"], row["flags"],
            row["attention"], row["padding"]) == ("tp1-sdpa-flash", "attention", 1, 0, "prefill", "deterministic",
                                                  "sdpa-flash", "auto")
    assert set(run.records["configuration"]) == {"tp1-sdpa-flash"}


def test_attention_and_padding_refusals():
    """Where the axis cannot apply, one line and exit 2: eager attention (other layer inputs than
    SDPA's), any padding side in compare (its sequences carry no padding)."""
    r = run_cli("compare", "--tp", "1", "--attention", "sdpa,eager")
    assert r.returncode == 2 and "--attention eager: not an axis of compare" in r.stderr, r.stderr
    # eager alone runs every configuration eager, for an hf: model: the presets have no switch
    r = run_cli("compare", "--tp", "1,2", "--attention", "eager")
    assert r.returncode == 2 and "--attention eager: only hf: models switch" in r.stderr, r.stderr
    r = run_cli("compare", "--tp", "1,2", "--padding", "left")
    assert r.returncode == 2 and "not an axis of compare" in r.stderr, r.stderr


def test_report_names_configurations_by_their_axes(hf_runs):
    """With an axis beyond TP the report's tables are "configuration x module" and name each
    configuration by its axes; a TP-only run's stay "Degree x module" (tests/test_report.py)."""
    from tpdiag.reports.html import render

    out, _ = hf_runs
    html = render(out)
    assert "Configuration x module" in html and "Degree x module" not in html
    assert "max ULP TP=1 sdpa-flash" in html
    # the header lists them too (it read "degrees 1 (reference TP=1)" for a run of two configurations)
    assert "configurations TP=1, TP=1 sdpa-flash (reference TP=1)" in " ".join(html.split()), html[:3000]
