"""The logprobs' rounding bound follows the trainer's recipe that world.json names (diff/engine._recipe,
diff/bounds.logprob_bound: a temperature T divides it by T). Nothing checked world.json's recipe against
manifest.json's: tp2/world.json edited to trainer_temperature 1e-9 moved the logprobs' bound from 6.6e-5
to 743 and `tpdiag gate --allow rounding` passed the run (exit 0). Now a world whose recipe is not the
manifest's - the default's keys left out on either side - is a corrupt run directory (exit 2)."""
import json
import shutil

from tests.conftest import run_cli


def _edit(run, label, **keys):
    p = run / f"tp{label}" / "world.json"
    w = json.loads(p.read_text())
    for k, v in keys.items():
        if v is None:
            w["config"].pop(k, None)
        else:
            w["config"][k] = v
    p.write_text(json.dumps(w))


def test_a_world_json_whose_recipe_is_not_the_manifests_fails_the_gate(tmp_path):
    run = tmp_path / "r"
    p = run_cli("compare", "--tp", "1,2", "--forward-only", "--no-confirm", "--no-baseline",
                "--trainer-temperature", "0.7", "--out", str(run), env={"OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    assert run_cli("gate", str(run), "--allow", "rounding").returncode == 0
    for label, keys in [("2", {"trainer_temperature": 1e-9}),  # the bound loosened 1e7x
                        ("1", {"trainer_temperature": None}),  # the default's, where the manifest names 0.7
                        ("2", {"logprob": "model-dtype"})]:
        bad = tmp_path / f"bad-{label}-{'-'.join(keys)}"
        shutil.copytree(run, bad, symlinks=True)
        _edit(bad, label, **keys)
        g = run_cli("gate", str(bad), "--allow", "rounding")
        assert g.returncode == 2, (keys, g.stdout[-2000:])
        assert f"tp{label}/world.json ran {next(iter(keys))}" in g.stdout + g.stderr, g.stdout[-2000:]
