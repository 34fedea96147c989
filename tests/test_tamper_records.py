"""Tampered record sets that re-diff clean (red team hred14; records/completeness.py): a tensor slipped
into records.safetensors that no record names, and every backward record cut from both sides alike
(their tensors, the indices and world.json's counts made to agree). Each is a corrupt capture: the
gate exits 2 (DESIGN: fail closed), and `tpdiag diff` of the cut worlds refuses them. On the old
code the gate passed the first (it never read the tensor), and `tpdiag diff` of the cut worlds wrote
a run whose gate passed - a bug in the backward alone (vocab_loss.py:vce_onehot) read rounding.

One real compare (conftest's shared TP=1,2 run); every case edits a copy of it."""
import json
import shutil

import pytest

from conftest import run_cli


@pytest.fixture()
def run(tp12_run, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(tp12_run, dst)
    return dst


def _gate(run):
    return run_cli("gate", str(run), "--allow", "rounding")


def _cut_backward(world):
    """The world's backward records removed, the rest renumbered, its tensors and counts made to agree."""
    from safetensors.torch import load_file, save_file

    events = [json.loads(ln) for ln in (world / "events.jsonl").read_text().splitlines()]
    tensors = load_file(str(world / "records.safetensors"))
    kept = [m for m in events if m["phase"] != "backward"]
    assert len(kept) < len(events)  # the fixture ran backward
    out = {str(j): tensors[str(m["idx"])] for j, m in enumerate(kept) if str(m["idx"]) in tensors}
    save_file(out, str(world / "records.safetensors"), metadata={"schema": "1"})
    (world / "events.jsonl").write_text("".join(json.dumps({**m, "idx": j}) + "\n" for j, m in enumerate(kept)))
    w = json.loads((world / "world.json").read_text())
    w["n_records"] = len(kept)
    (world / "world.json").write_text(json.dumps(w))


def test_the_untouched_copy_passes(run):
    p = _gate(run)
    assert p.returncode == 0, p.stdout + p.stderr


def test_a_tensor_no_record_names_is_inconclusive(run):
    from safetensors.torch import load_file, save_file
    import torch

    path = run / "tp2" / "records.safetensors"
    tensors = load_file(str(path))
    tensors[str(10 ** 6)] = torch.zeros(3)
    save_file(tensors, str(path), metadata={"schema": "1"})
    p = _gate(run)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "INCONCLUSIVE" in p.stdout and "tensor(s) that no record" in p.stdout and "records.safetensors" in p.stdout, p.stdout


def test_worlds_with_every_backward_record_cut_are_refused(run, tmp_path):
    worlds = tmp_path / "cut"
    worlds.mkdir()
    for lab in ("tp1", "tp2"):
        shutil.copytree(run / lab, worlds / lab)
        _cut_backward(worlds / lab)
    p = run_cli("diff", str(worlds / "tp1"), str(worlds / "tp2"), "--out", str(tmp_path / "d"))
    assert p.returncode == 2, p.stdout + p.stderr
    assert "no backward record of step 0" in p.stdout + p.stderr, p.stdout + p.stderr
    # the same cut in place, under the run's own summary: inconclusive, and it says why
    for lab in ("tp1", "tp2"):
        _cut_backward(run / lab)
    g = _gate(run)
    assert g.returncode == 2 and "no backward record of step 0" in g.stdout, g.stdout
