"""The own-input pass's reference writes only its float64 records and reads the rest from the region
reference's folder (WorldConfig.records_base, records/store.py): every record read through it is still
checked - each tensor against its own stored hash, the base proven this world's configuration and
step (its fingerprint) - and the gate calls a run whose base was edited inconclusive."""
import json

import pytest
import torch
from conftest import run_cli
from safetensors.torch import load_file, save_file

from tpdiag.errors import Inconclusive
from tpdiag.records.base_world import base_drop
from tpdiag.records.store import RecordSet, read_index



@pytest.fixture(scope="module")
def run(behind_hash_run):
    """conftest.BEHIND_HASH's one session compare (behind.py:bugs, TP=1,2, --capture hash), shared with
    test_own_norms: read here, edited only in copies (_copy)."""
    return behind_hash_run


def _copy(run, tmp_path):
    import shutil

    d = tmp_path / "run"
    shutil.copytree(run, d)
    return d


def _own(d):
    return d / "region" / "ops" / "tp1"


def _gate(d):
    return run_cli("gate", str(d))


def test_the_union_is_the_base_less_its_float64_records_then_its_own(run):
    own, base = RecordSet(str(_own(run))), RecordSet(str(run / "region" / "tp1"))
    mine = [json.loads(line) for line in (_own(run) / "events.jsonl").read_text().splitlines()]
    assert mine and {m["kind"] for m in mine} == {"oracle"}
    drop = base_drop(own.world["config"], base.world["config"])
    assert drop == ("op", "oracle")  # the region pass recorded the first divergence's ops, this pass none
    below = [m["key"] for m in base.events if m["kind"] not in drop]
    assert [m["key"] for m in own.events] == below + [m["key"] for m in mine]
    assert [m["idx"] for m in own.events] == list(range(len(own.events)))
    assert [m["key"] for m in read_index(str(_own(run)))[1]] == [m["key"] for m in own.events]
    for m in own.events:  # every record reads, checked against its stored hash, from its own file
        t = own.tensor(m)
        src = base if m["kind"] != "oracle" else RecordSet(str(_own(run)))
        assert torch.equal(t, src.tensor(src.by_key[m["key"]]))


def test_an_edited_base_record_is_refused(run, tmp_path):
    d = _copy(run, tmp_path)
    path = d / "region" / "tp1" / "records.safetensors"
    rs = RecordSet(str(_own(d)))
    m = next(m for m in rs.events if m["kind"] == "out" and m.get("stored") != "hash")
    stored = str(RecordSet(str(d / "region" / "tp1")).by_key[m["key"]]["idx"])  # its number in the base's file
    rs.tensor(m)  # the control: read and checked before the edit
    tensors = load_file(str(path))
    tensors[stored] = tensors[stored] + 1
    save_file(tensors, str(path), metadata={"schema": "1"})
    with pytest.raises(Inconclusive, match="does not match its hash"):
        RecordSet(str(_own(d))).tensor(m)


def test_a_base_of_another_step_makes_the_gate_inconclusive(run, tmp_path):
    assert _gate(run).returncode == 4  # the control: FAIL (the planted bug), not inconclusive
    d = _copy(run, tmp_path)
    p = d / "region" / "tp1" / "world.json"
    w = json.loads(p.read_text())
    fp = w["fingerprint"][0]
    fp[next(iter(fp))] = "0" * 16
    p.write_text(json.dumps(w))
    with pytest.raises(Inconclusive, match="computed another step"):
        RecordSet(str(_own(d)))
    g = _gate(d)
    assert g.returncode == 2 and "computed another step" in g.stdout + g.stderr, g.stdout + g.stderr


def test_a_base_outside_the_pass_is_refused(run, tmp_path):
    d = _copy(run, tmp_path)
    p = _own(d) / "world.json"
    w = json.loads(p.read_text())
    w["config"]["records_base"] = str(d / "tp1")  # pass 1's reference: not the region pass's
    p.write_text(json.dumps(w))
    with pytest.raises(Inconclusive, match="not a world folder beside"):
        RecordSet(str(_own(d)))
    g = _gate(d)
    assert g.returncode == 2 and "records_base" in g.stdout + g.stderr, g.stdout + g.stderr


def test_a_base_dropped_from_world_json_is_inconclusive(run, tmp_path):
    # red team hred10: world.json's records_base removed, the own-input reference read as a set of its own
    # (its float64 records alone) - on a rounding-only run (tiny-llama --capture hash) the gate passed it
    # (exit 0); the manifest's worlds entry names the base the compare ran it on
    d = _copy(run, tmp_path)
    p = _own(d) / "world.json"
    w = json.loads(p.read_text())
    assert w["config"].pop("records_base")
    p.write_text(json.dumps(w))
    g = _gate(d)
    assert g.returncode == 2 and "records_base None is not the base manifest.json ran it on" in g.stdout, \
        g.stdout + g.stderr


@pytest.mark.parametrize("gone,words", [("summary.json", "ran (its manifest.json is there) but its summary.json is missing"),
                                        ("", "is missing, but region/summary.json left modules to judge")])
def test_the_own_input_pass_removed_is_inconclusive(run, tmp_path, gone, words):
    # red team hred10: region/ops/summary.json (or the whole own-input pass) deleted - its findings, a bug
    # judged on its own inputs, dropped unseen with it - passed gate --allow rounding (exit 0) on a
    # rounding-only run (tiny-llama --capture hash); here the planted bugs' run read as FAIL (exit 4)
    d = _copy(run, tmp_path)
    p = d / "region" / "ops" / gone
    if gone:
        p.unlink()
    else:
        import shutil

        shutil.rmtree(p)
    g = _gate(d)
    assert g.returncode == 2 and words in g.stdout, g.stdout + g.stderr
