"""The benchmark entry point on CPU: job list, one tiny job recorded as a JSON line, the errors
(unknown job, module not in the checkout, needs CUDA), and the MFU formula's parameter count."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REQUIRED = {"date", "host", "machine", "gpu", "torch", "triton", "cuda", "commit", "job", "args", "figures"}


def bench(*args, env=None, timeout=120):
    e = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for k in ("OUT", "TPDIAG_BENCH_RESULTS", "TPDIAG_BENCH_NO_RECORD"):
        e.pop(k, None)
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "benchmarks", *args], cwd=ROOT, env=e, capture_output=True,
                          text=True, timeout=timeout)


def test_list_names_every_job():
    from benchmarks.registry import JOBS

    p = bench("--list")
    assert p.returncode == 0, p.stderr
    listed = {ln.split()[0] for ln in p.stdout.splitlines() if ln.strip()}
    assert listed == set(JOBS)
    assert {"fix-cost", "gemm", "probes", "tree-kernels", "record-hash", "split-gemm", "compare-1b",
            "attention", "suite"} <= listed


def test_tiny_job_appends_one_json_line(tmp_path):
    results, out = tmp_path / "r.jsonl", tmp_path / "out"
    out.mkdir()
    results.write_text('{"earlier": 1}\n')  # history is appended to, never rewritten
    args = ("probes", "overhead", "--model", "tiny-llama", "--dtype", "float32", "--batch", "1", "--seq", "8",
            "--rounds", "1", "--modes", "none,hash", "--peak-tflops", "0.01")
    p = bench("--results", str(results), *args, env={"OUT": str(out), "TPDIAG_GIT_COMMIT": "abc123"})
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    assert "| none |" in p.stdout and "| hash |" in p.stdout  # the table
    lines = results.read_text().splitlines()
    assert len(lines) == 2 and json.loads(lines[0]) == {"earlier": 1}
    rec = json.loads(lines[1])
    assert REQUIRED <= set(rec), REQUIRED - set(rec)
    assert rec["job"] == "probes" and rec["args"] == list(args[1:]) and rec["commit"] == "abc123"
    assert rec["torch"] == torch.__version__
    fig = rec["figures"]
    assert set(fig["modes"]) == {"none", "hash"} and fig["modes"]["hash"]["records"] > 0
    # MFU of the unprobed step = model FLOPs / (step s * peak), from the recorded figures
    none_s = fig["modes"]["none"]["step_ms"] / 1e3
    assert fig["mfu_no_probes"] == pytest.approx(fig["step_flops"] / (none_s * 0.01e12))
    # the same line for the device machine's $OUT
    assert (out / "results.jsonl").read_text().splitlines() == [lines[1]]


def test_unknown_job_is_one_line_exit_2():
    p = bench("no-such-job")
    assert p.returncode == 2
    assert len(p.stderr.strip().splitlines()) == 1 and "no-such-job" in p.stderr and "fix-cost" in p.stderr


def test_registered_job_without_module_is_one_line_exit_3(monkeypatch, capsys):
    from benchmarks import cli, registry

    monkeypatch.setitem(registry.JOBS, "later", registry.Job("benchmarks.not_written_yet", "x", "CPU"))
    assert cli.main(["--no-record", "later"]) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "benchmarks.not_written_yet" in err[0]


def test_probe_modes_are_checked_up_front():
    # a mistyped mode is argparse's error, exit 2, before any model is built (overhead and
    # profile --kineto)
    for args in (("probes", "overhead", "--modes", "none,hash-itres4"),
                 ("probes", "profile", "--kineto", "--modes", "none,hash-itres4"),
                 ("probes", "profile", "--kineto", "--modes", "none,hash@warm")):
        p = bench("--no-record", *args)
        assert p.returncode == 2, (args, p.stderr)
        assert "error: --modes: unknown" in p.stderr.strip().splitlines()[-1], (args, p.stderr)
    # hash-base times another commit's kernel: without its file, the same up-front error
    e = {k: v for k, v in os.environ.items() if k != "PROBES_BASE_KERNEL"}
    p = subprocess.run([sys.executable, "-m", "benchmarks", "--no-record", "probes", "overhead", "--modes",
                        "none,hash-base"], cwd=ROOT, env=dict(e, PYTHONPATH=ROOT), capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2 and "needs PROBES_BASE_KERNEL=FILE" in p.stderr.strip().splitlines()[-1], p.stderr
    p = bench("--no-record", "probes", "overhead", "--block", "0")
    assert p.returncode == 2 and "--block must be at least 1, not 0" in p.stderr.strip().splitlines()[-1], p.stderr
    for bad in ("-5", "nan", "inf"):
        p = bench("--no-record", "probes", "overhead", "--rest", bad)
        assert p.returncode == 2 and f"--rest must be a finite number of ms >= 0, not {bad}" in \
            p.stderr.strip().splitlines()[-1], p.stderr


def test_probes_overhead_block_and_rest():
    # --block 2: each kept step follows an unkept one of its own mode; --rest: a pause before
    # every step but the first. Tiny-llama on CPU: 2 warm-ups + 1 round x 2 modes x 2 steps = 6
    # steps. In a child process: the job rebinds runner.step.build_model and sets torch's threads
    # and determinism for the process, which would leak into later tests.
    code = (
        "import json, sys, time\n"
        "from benchmarks.jobs import probes\n"
        "slept = []\n"
        "time.sleep = slept.append\n"
        "r = probes.main(sys.argv[1:])\n"
        "h = r['modes']['hash@warm']\n"
        "print('RESULT ' + json.dumps([r['block'], r['rest_ms'], r['order'], slept,\n"
        "                              h['after_unprobed_ms'], h['after_probed_ms']]))\n")

    def run(*args):
        e = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        p = subprocess.run([sys.executable, "-c", code, "overhead", "--smoke", "--modes", "none@warm,hash@warm",
                            *args], cwd=ROOT, env=e, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr
        return json.loads(next(line for line in p.stdout.splitlines() if line.startswith("RESULT "))[7:])

    block, rest, order, slept, after_unprobed, after_probed = run("--block", "2", "--rest", "40")
    assert (block, rest) == (2, 40.0)
    assert "each kept step after 1 unkept of its own mode" in order and "at least 40 ms" in order
    assert len(slept) == 5 and all(0 < s <= 0.04 for s in slept), slept
    assert after_unprobed == "-" and after_probed.endswith("(1)")
    block, rest, order, slept, after_unprobed, after_probed = run()
    assert (block, rest, slept) == (1, 0.0, []) and after_unprobed.endswith("(1)") and after_probed == "-"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_cuda_only_job_says_needs_cuda_exit_3():
    p = bench("record-hash")
    assert p.returncode == 3
    assert p.stderr.strip().splitlines() == ["benchmarks: record-hash needs CUDA (no CUDA device here); "
                                             "the torch path is checked on CPU by tests/test_hashing.py"]


def test_mfu_params_are_the_models_linear_weights():
    from benchmarks.mfu import preset_dims, step_flops
    from tpdiag.models.spec import load_target, parse_spec

    model = load_target(parse_spec("tiny-llama")).model
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    dims = preset_dims("tiny-llama")
    assert dims["matmul_params"] == linear
    b, s = 2, 64
    assert step_flops("tiny-llama", b, s) == 6 * linear * b * s + 6 * dims["layers"] * s * s * dims["hidden"] * b


def test_ingest_appends_only_new_lines(tmp_path):
    from benchmarks.record import ingest

    dst, src = tmp_path / "hist.jsonl", tmp_path / "new.jsonl"
    dst.write_text('{"a": 1}\n')
    src.write_text('{"a": 1}\n{"b": 2}\n')
    assert ingest(str(src), str(dst)) == 1
    assert ingest(str(src), str(dst)) == 0
    assert dst.read_text() == '{"a": 1}\n{"b": 2}\n'


def test_hash_kernels_gpu_path_compiles_for_sm90():
    """The record hash's bf16 word-pairs path carries inline PTX (the packed max, h + K, the high
    half's bits) that the Triton interpreter - CI's way of running the kernels - never sees. Compile
    the batch kernel for sm_90 on the CPU (Triton's bundled ptxas, as `probes sass` does; in a
    subprocess without TRITON_INTERPRET, which other tests set in this process) and check the PTX
    made it into the loop: a packed bf16x2 max and no fp32 max, and fewer instructions an element
    than the element-by-element path. (Bit for bit on a GPU: `python -m benchmarks record-hash`.)"""
    pytest.importorskip("triton")
    code = """
import json
from benchmarks.jobs.probes_sass import loop_mix
try:
    pairs, elems = loop_mix(16, True, True), loop_mix(16, True, False)
except FileNotFoundError as e:  # a Triton build without the CUDA tools
    print(json.dumps({"skip": str(e)}))
else:
    print(json.dumps({"pairs": pairs, "elems": elems}))
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       env=dict(env, PYTHONPATH=ROOT), timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    if "skip" in got:
        pytest.skip(f"no ptxas/cuobjdump in this Triton: {got['skip']}")
    pairs, elems = got["pairs"], got["elems"]
    assert pairs["ops"].get("HMNMX2", 0) + pairs["ops"].get("VHMNMX", 0) > 0, pairs["ops"]
    assert "FMNMX" not in pairs["ops"], pairs["ops"]
    assert pairs["per_element"] < elems["per_element"], (pairs["per_element"], elems["per_element"])


def test_hash_word_pairs_need_sm86(monkeypatch):
    """The packed max needs sm_86: an A100 (sm_80) hashes bf16 element by element, Hopper and Ada
    take the word pairs (the interpreter, on CPU tensors, always)."""
    from tpdiag.kernels import record_hash as rh

    for cap, want in (((8, 0), False), ((8, 6), True), ((9, 0), True)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None, cap=cap: cap)
        assert rh.pairs_ok.__wrapped__(torch.device("cuda", 0)) is want, cap
    assert rh.pairs_ok(torch.device("cpu")) is True


def test_overhead_order_puts_each_probed_mode_after_the_unprobed_step_in_turn():
    """`probes overhead`: the step right after the unprobed one costs more (allocator state, seen
    on an H200), so each probed mode takes that place equally often, and the unprobed step stays
    first in its round (its pairs are the round's)."""
    from benchmarks.jobs.probes import _order

    modes = ["none@warm", "hash@warm", "hash-elem@warm", "full@warm"]
    rounds = [_order(modes, k) for k in range(6)]
    assert all(sorted(r) == sorted(modes) and r[0] == "none@warm" for r in rounds)
    firsts = [r[1] for r in rounds]
    assert sorted(firsts) == sorted(modes[1:] * 2), firsts


def test_table_prints_a_jobs_history_one_line_per_run_row(tmp_path, capsys):
    from benchmarks.cli import main

    path = tmp_path / "r.jsonl"
    recs = [
        {"date": "2026-01-01T00:00:00+00:00", "job": "fix-cost", "args": ["--tp", "2"], "gpu": "NVIDIA H200",
         "commit": "aaa1111", "figures": {"model": "llama-1b", "rows": [
             {"tp": 2, "batch": 8, "seq": 4096, "configs": {"stock": {"ms": 474.7, "x_stock": 1.0},
                                                           "all fixes": {"ms": 990.1, "x_stock": 2.0857}}},
             {"tp": 2, "batch": 1, "seq": 2048, "configs": {"stock": {"ms": 238.5, "x_stock": 1.0}}}]}},
        {"date": "2026-01-02T00:00:00+00:00", "job": "gemm", "args": [], "gpu": None, "machine": "x86_64",
         "commit": "bbb2222", "figures": {"ok": True}},
        {"date": "2026-01-03T00:00:00+00:00", "job": "fix-cost", "args": [], "gpu": "NVIDIA H100 80GB HBM3",
         "commit": "ccc3333", "figures": {"rows": [{"tp": 4, "batch": 8, "seq": 4096,
                                                    "configs": {"stock": {"ms": 300.0, "x_stock": 1.0}}}]}},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs) + "not json\n")
    assert main(["--table", "fix-cost", "--results", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    head = lines[0].split()
    assert head[:3] == ["date", "commit", "gpu"] and "configs.all" in lines[0] and head[-1] == "args"
    assert [ln.split()[2] for ln in lines[1:]] == ["aaa1111", "aaa1111", "ccc3333"]  # oldest first, a line per row
    assert "990.1" not in lines[1] and "2.086" in lines[1] and "-" in lines[2].split()  # x_stock, '-' where absent
    assert main(["--table", "fix-cost", "--results", str(path), "--last", "1", "--columns", "configs.*.ms"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and "configs.stock.ms" in lines[0] and "300" in lines[1] and "H100" in lines[1]
    assert main(["--table", "no-such-job", "--results", str(path)]) == 2


def test_table_reads_the_committed_history():
    # every job with recorded runs prints one line per run row from benchmarks/results.jsonl
    from benchmarks import record, table
    from benchmarks.registry import JOBS

    for job in JOBS:
        recs = table.load(record.DEFAULT_RESULTS, job)
        if recs:
            out = table.table(recs, JOBS[job].table)
            assert len(out) == 1 + sum(len(table.rows_of(r)) for r in recs), job
            assert len(out[0].split()) > 4, (job, out[0])  # the default columns exist in the records


def test_a_signal_to_the_runner_kills_its_child_group(tmp_path):
    """run_group's child has its own session (so that a time limit can kill it whole); a SIGTERM
    to the runner itself - an outer `timeout` - must kill that group too, or its ranks outlive
    the runner (a timed-out compare kept a GPU machine busy under the next timing job).
    Negative control: the same child without run_group's handler survives its parent."""
    import signal
    import subprocess
    import sys
    import time

    def run(use_handler: bool) -> bool:
        pidfile = tmp_path / f"pid-{use_handler}"
        child = [sys.executable, "-c", f"import os, time; open({str(pidfile)!r}, 'w').write(str(os.getpid())); "
                 "time.sleep(60)"]
        if use_handler:
            body = f"from benchmarks.proc import run_group; run_group({child!r}, 120)"
        else:
            body = f"import subprocess; subprocess.Popen({child!r}, start_new_session=True).wait()"
        parent = subprocess.Popen([sys.executable, "-c", body], cwd=ROOT)
        for _ in range(200):
            if pidfile.exists() and pidfile.read_text():
                break
            time.sleep(0.05)
        pid = int(pidfile.read_text())
        parent.send_signal(signal.SIGTERM)
        parent.wait(timeout=30)
        for _ in range(100):  # the child is reaped by init once killed; poll until it is gone
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return False
            time.sleep(0.05)
        os.kill(pid, signal.SIGKILL)
        return True

    assert not run(True), "run_group's child outlived its runner"
    assert run(False), "negative control: a new-session child should outlive a plain parent"
