"""The suite's compare and rollout runs are CPU runs unless a test names its device: `--device auto`
(the commands' default) is CUDA on a GPU machine, where tests asserting CPU facts (planted masks
and causes on gloo, the CPU's fused rms_norm) failed without a wrong verdict (7 failed, 5 errors on
an H200). tests/conftest.run_cli pins `--device cpu` (on_cpu), and the pin reaches the run: the
manifest's config says cpu where it said auto."""
import json

from conftest import on_cpu


def test_on_cpu_pins_compare_and_rollout_only_where_no_device_is_named():
    assert on_cpu(["compare", "--tp", "1,2"]) == ["compare", "--device", "cpu", "--tp", "1,2"]
    assert on_cpu(["rollout", "f.jsonl", "--model", "m"]) == ["rollout", "--device", "cpu", "f.jsonl", "--model", "m"]
    for named in (["compare", "--device", "cuda"], ["compare", "--device=auto"], ["rollout", "f", "--device", "cuda"]):
        assert on_cpu(named) == named
    for other in (["gate", "run"], ["confirm", "run"], ["report", "run"], []):
        assert on_cpu(other) == other


def test_the_pin_reaches_the_manifest(tp12_run):
    """tp12_run is conftest's `run_cli("compare", "--tp", "1,2", ...)`, no --device: the manifest's
    config has the pinned device (before: "auto", CUDA on a GPU machine) and its worlds ran gloo."""
    m = json.loads((tp12_run / "manifest.json").read_text())
    assert m["config"]["device"] == "cpu"
    assert m["backend"] == "gloo"
