"""Faults beyond a raising/dying/hanging rank (tests/test_faults.py): two compares at once, a full
disk, an interrupted or killed compare, truncated and edited records, NaN/Inf activations, an OOM
at one degree. Each must end in one readable line and the right exit code (2: inconclusive), keep
the other degrees' results, never read as a pass, and leave no process behind.

Worlds are tiny (a 2-layer MLP LM at TP=1,2, --no-confirm --no-baseline) and few: one pair of
concurrent compares shared by most tests (copies are damaged, never the originals).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid

import pytest
from typer.testing import CliRunner

from conftest import ROOT, on_cpu

# py: targets for the faults. Written to a file at test time (the spec is py:FILE.py:FUNC).
TARGETS_SRC = '''
import torch
import torch.distributed as dist
from torch import nn

import tpdiag

VOCAB, DIM, HIDDEN = 64, 32, 64


def _world():
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class Poison(nn.Module):
    """Identity at TP=1; at TP>1 writes +inf into one element (as a 1/(world-2) bug would)."""

    def forward(self, x):
        if _world() > 1:
            x = x.clone()
            x[..., 0, 0] = float("inf")
        return x


class OOM(nn.Module):
    """Rank 0 of a TP>1 world runs out of memory in the forward; its peer is then stuck in a collective."""

    def forward(self, x):
        if _world() > 1 and dist.get_rank() == 0:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 512.00 GiB (simulated)")
        return x


class LM(nn.Module):
    def __init__(self, mid):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.mid = mid
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, input_ids):
        h = self.mid(self.embed(input_ids))
        h = h + self.fc2(torch.relu(self.fc1(h)))
        return self.head(self.norm(h))


def plan():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}


def plain_target():
    return tpdiag.Target(model=LM(nn.Identity()), plan=plan(), vocab_size=VOCAB)


def nan_target():
    return tpdiag.Target(model=LM(Poison()), plan=plan(), vocab_size=VOCAB)


def oom_target():
    return tpdiag.Target(model=LM(OOM()), plan=plan(), vocab_size=VOCAB)
'''

SMALL = ("--no-confirm", "--no-baseline")
TAG_ENV = "TPDIAG_TEST_TAG"


def strict_json(text: str):
    """json.loads that rejects the non-standard NaN/Infinity tokens (as jq and JavaScript do)."""
    def refuse(token):
        raise ValueError(f"non-standard JSON token {token}")

    return json.loads(text, parse_constant=refuse)


def write_targets(directory) -> str:
    path = os.path.join(str(directory), "fault_targets.py")
    with open(path, "w") as f:
        f.write(TARGETS_SRC)
    return path


# -- processes ---------------------------------------------------------------------------------
def tagged(tag: str) -> list[int]:
    """Live processes started for this test: every process of a compare (the CLI, multiprocessing's
    resource tracker, the fork server, the ranks) inherits TPDIAG_TEST_TAG. Zombies: not counted."""
    needle = f"{TAG_ENV}={tag}".encode()
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rpartition(")")[2].split()[0]
        except OSError:
            continue
        if needle in env and state != "Z":
            out.append(int(pid))
    return out


def assert_no_orphans(tag: str, wait_s: float = 15.0) -> None:
    end = time.monotonic() + wait_s
    while tagged(tag) and time.monotonic() < end:
        time.sleep(0.2)
    left = tagged(tag)
    cmdlines = []
    for pid in left:
        try:
            cmdlines.append(open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ")[:120])
        except OSError:
            pass
    if left:
        kill_tagged(tag)
    assert not left, f"processes left behind: {left} {cmdlines}"


def _sigint_default() -> None:
    # A shell without job control starts a background job (`pytest ... &`, a CI step run so)
    # with SIGINT ignored, the child inherits that, and Python then installs no KeyboardInterrupt
    # handler: an interrupt test would send a signal its compare never sees. A terminal's Ctrl-C
    # reaches a foreground compare with SIGINT at its default, as here.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def start(*args, tag: str, env=None) -> subprocess.Popen:
    e = {k: v for k, v in os.environ.items() if k != "TPDIAG_FAULT"}
    e.update(env or {})
    e.update({"COLUMNS": "160", TAG_ENV: tag})
    return subprocess.Popen([sys.executable, "-m", "tpdiag.cli", *on_cpu(args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=e, cwd=ROOT, preexec_fn=_sigint_default)


def kill_tagged(tag: str) -> None:
    """Clean up after a failed test: only the processes this test started (by their tag)."""
    for pid in tagged(tag):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def finish(p: subprocess.Popen, timeout: float = 300, tag: str | None = None):
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # with PYTHONFAULTHANDLER set, its threads' stacks go to stderr first
        p.send_signal(signal.SIGABRT)
        try:
            p.wait(5)
        except subprocess.TimeoutExpired:
            pass
        p.kill()
        if tag:
            kill_tagged(tag)  # the pipes stay open while any child holds them
        out, err = p.communicate(timeout=60)
        raise AssertionError(f"compare did not end in {timeout} s: {err[-6000:]}")
    return p.returncode, out, err


def one_line_error(err: str) -> str:
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert "Traceback" not in err, err
    assert len(lines) == 1, err
    return lines[0]


# -- shared runs -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    return write_targets(tmp_path_factory.mktemp("targets"))


@pytest.fixture(scope="module")
def pair(targets, tmp_path_factory):
    """Two compares started at the same moment into different directories (each binds its own
    rendezvous port): a plain model, and one whose TP=2 activations hold +inf (then NaN). The plain
    run's readers check its first divergence and damage its records: no own-input judgement there
    (a second pass of both worlds); the NaN run keeps the default flow, the gate's input included."""
    base = tmp_path_factory.mktemp("pair")
    runs = {}
    for name, func, extra in (("plain", "plain_target", ("--no-judge-downstream",)), ("nan", "nan_target", ())):
        tag = uuid.uuid4().hex
        out = base / name
        p = start("compare", "--model", f"py:{targets}:{func}", "--tp", "1,2", *SMALL, *extra, "--out", str(out),
                  "--format", "json", tag=tag)
        runs[name] = (p, out, tag)
    done = {}
    for name, (p, out, tag) in runs.items():
        rc, stdout, stderr = finish(p, tag=tag)
        done[name] = {"rc": rc, "stdout": stdout, "stderr": stderr, "out": out, "tag": tag}
    return done


@pytest.fixture()
def plain_copy(pair, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(pair["plain"]["out"], dst)
    return dst


# -- two compares at once ----------------------------------------------------------------------
def test_two_compares_at_the_same_time_both_succeed(pair):
    for name, r in pair.items():
        assert r["rc"] == 0, (name, r["stderr"][-3000:])
        s = json.loads(r["stdout"])
        assert s["status"] == "divergent" and s["degrees"]["2"]["status"] == "divergent", (name, s)
        m = json.loads((r["out"] / "manifest.json").read_text())
        assert all(w["status"] == "ok" for w in m["worlds"].values()), m["worlds"]
        assert_no_orphans(r["tag"])
    # Each wrote its own directory: the summaries name their own model's first divergence.
    a = json.loads((pair["plain"]["out"] / "summary.json").read_text())["degrees"]["2"]["first_divergence"]
    b = json.loads((pair["nan"]["out"] / "summary.json").read_text())["degrees"]["2"]["first_divergence"]
    assert a["module"] == "fc2" and b["module"] == "mid", (a, b)


# -- NaN / Inf ---------------------------------------------------------------------------------
def test_inf_and_nan_activations_are_a_divergence_in_strict_json(pair):
    out = pair["nan"]["out"]
    text = (out / "summary.json").read_text()
    s = strict_json(text)  # no bare NaN/Infinity tokens
    d = s["degrees"]["2"]
    fd = d["first_divergence"]
    # The poisoned module is the first divergence (its input was bitwise equal), compared on raw bits.
    assert (fd["phase"], fd["module"], fd["kind"]) == ("forward", "mid", "out"), fd
    assert fd["max_abs"] == "Infinity" and fd["mismatch_fraction"] > 0
    assert d["loss"]["value"] == "NaN" and isinstance(d["loss"]["reference"], float)
    # Read back through tpdiag, the strings are floats again.
    from tpdiag.base import files as io

    back = io.read_json(str(out / "summary.json"))["degrees"]["2"]
    assert back["first_divergence"]["max_abs"] == float("inf") and back["loss"]["value"] != back["loss"]["value"]
    for f in ("manifest.json",):
        strict_json((out / f).read_text())
    for line in (out / "tp2" / "events.jsonl").read_text().splitlines():
        strict_json(line)
    from tpdiag.records.rundir import read_rows

    rows = {r["key"]: r for r in read_rows(str(out / "diff.csv"))}
    assert rows[fd["key"]]["max_abs"] == float("inf") and rows[fd["key"]]["bitwise"] is False


def test_inf_and_nan_summary_on_stdout_is_strict_json(pair):
    strict_json(pair["nan"]["stdout"])


def test_gate_and_report_handle_nan_runs(pair, tmp_path):
    from tpdiag.cli import app

    out = str(pair["nan"]["out"])
    r = CliRunner().invoke(app, ["gate", out, "--format", "json"])
    assert r.exit_code == 4, r.output  # a non-finite finding beyond policy, named; not a crash, not a pass
    g = strict_json(r.stdout)
    assert g["first_violation"]["module"] == "mid" and g["first_violation"]["max_abs"] == "Infinity"
    r = CliRunner().invoke(app, ["report", out, "-o", str(tmp_path / "r.html")])
    assert r.exit_code == 0 and r.exception is None, r.output
    assert "mid" in (tmp_path / "r.html").read_text()


# -- OOM at one degree -------------------------------------------------------------------------
def test_oom_at_one_degree_fails_only_that_degree(targets, tmp_path):
    tag = uuid.uuid4().hex
    out = tmp_path / "oom"
    # TP=1,2,1: the repeated TP=1 is a second comparison that must survive TP=2's failure.
    p = start("compare", "--model", f"py:{targets}:oom_target", "--tp", "1,2,1", *SMALL, "--out", str(out),
              tag=tag)
    rc, stdout, stderr = finish(p, tag=tag)
    assert rc == 2, stderr[-3000:]
    assert "Traceback" not in stdout + stderr
    assert "OutOfMemoryError" in stdout and "inconclusive" in stdout
    s = strict_json((out / "summary.json").read_text())
    assert s["status"] == "inconclusive"
    d2 = s["degrees"]["2"]
    assert d2["status"] == "failed"
    # the user's file:line where their code raised (issue 18: one line naming the frame)
    assert re.match(r"rank 0: OutOfMemoryError at \S*fault_targets\.py:\d+ in forward: CUDA out of memory",
                    d2["error"]), d2["error"]
    assert s["degrees"]["1-2"]["status"] == "bitwise"  # the other degree's result is kept
    assert_no_orphans(tag)
    from tpdiag.gate import evaluate

    res = evaluate(str(out))
    assert res.exit_code == 2 and "TP=2" in res.problems[0] and "OutOfMemoryError" in res.problems[0]


# -- disk full ---------------------------------------------------------------------------------
def _mount_tmpfs(path, size: int) -> bool:
    os.makedirs(path, exist_ok=True)
    if os.geteuid() != 0 or not shutil.which("mount"):
        return False
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                       capture_output=True, text=True)
    return p.returncode == 0


def _umount(path) -> None:
    subprocess.run(["umount", "-l", str(path)], capture_output=True)


def _dir_bytes(d) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d) if not f.startswith("rank"))


def _no_half_files(root) -> None:
    for dirpath, _, files in os.walk(root):
        assert not [f for f in files if f.startswith(".tmp-")], (dirpath, files)


def test_disk_full_in_process_leaves_nothing_half_written(tmp_path, monkeypatch):
    """ENOSPC while writing (simulated in-process): a typed, readable error, the previous file intact,
    no temp file left, and a record directory without its index reads as incomplete."""
    import errno

    import torch

    from tpdiag.base import files as io
    from tpdiag.errors import Inconclusive
    from tpdiag.records import store
    from tpdiag.records.store import RecordSet

    target = tmp_path / "summary.json"
    io.write_json(str(target), {"status": "old"})
    real_fsync = os.fsync

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(io.os, "fsync", full)
    with pytest.raises(io.WriteError) as ei:
        io.write_json(str(target), {"status": "new"})
    e = ei.value
    assert isinstance(e, Inconclusive) and isinstance(e, OSError) and e.errno == errno.ENOSPC
    assert str(e) == f"{target}: cannot write (No space left on device)"
    assert json.loads(target.read_text()) == {"status": "old"}
    _no_half_files(tmp_path)

    # The records file fails (written without fsync: the disk fills up in its write): no index
    # (events.jsonl) is ever written, so the degree is incomplete.
    monkeypatch.setattr(io.os, "fsync", real_fsync)
    real_fdopen, calls = os.fdopen, []

    class _Full:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return self.f.__exit__(*a)

        def write(self, b):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        def __getattr__(self, k):
            return getattr(self.f, k)

    def fdopen_full_on_first(fd, *a, **kw):
        calls.append(fd)
        f = real_fdopen(fd, *a, **kw)
        return _Full(f) if len(calls) == 1 else f

    monkeypatch.setattr(io.os, "fdopen", fdopen_full_on_first)
    meta = {"idx": 0, "key": "s0/init/model/batch#0/x", "step": 0, "phase": "init", "module": "model",
            "kind": "batch", "call": 0, "name": "x", "placement": None, "style": None, "cls": None,
            "dtype": "float32", "local_shape": [4], "stored": "single", "world": 1}
    with pytest.raises(io.WriteError):
        store.write(str(tmp_path / "tp1"), [(meta, torch.zeros(4))], {"degree": 1})
    assert not (tmp_path / "tp1" / "events.jsonl").exists()
    with pytest.raises(Inconclusive, match="missing"):
        RecordSet(str(tmp_path / "tp1"))
    _no_half_files(tmp_path)


def test_disk_full_on_a_real_filesystem(pair, targets, tmp_path):
    """A tmpfs with room for TP=1's records but not TP=2's: TP=2 fails with ENOSPC named, TP=1 is
    kept, the run is inconclusive (exit 2), the gate says so, and no partial file looks complete."""
    ref = pair["plain"]["out"]
    need = _dir_bytes(ref / "tp1") + 64 * 1024  # TP=1's records + manifest, summary, diff.csv, markers
    size = need + _dir_bytes(ref / "tp2") // 2
    mnt = tmp_path / "mnt"
    if not _mount_tmpfs(mnt, size):
        pytest.skip("cannot mount a tmpfs here (needs root); the in-process ENOSPC test covers the writer")
    tag = uuid.uuid4().hex
    try:
        out = mnt / "run"
        p = start("compare", "--model", f"py:{targets}:plain_target", "--tp", "1,2", *SMALL, "--out", str(out),
                  "--format", "json", tag=tag)
        rc, stdout, stderr = finish(p, tag=tag)
        assert rc == 2, stdout[-2000:] + stderr[-2000:]
        assert "Traceback" not in stdout + stderr
        assert "No space left on device" in stdout + stderr
        if (out / "summary.json").is_file():
            s = strict_json((out / "summary.json").read_text())
            assert s["status"] == "inconclusive"
            assert s["degrees"]["2"]["status"] == "failed"
            assert "No space left on device" in s["degrees"]["2"]["error"]
            m = json.loads((out / "manifest.json").read_text())
            assert m["worlds"]["1"]["status"] == "ok"  # the reference's result is kept
        else:  # the parent itself could not write: one line naming the file
            assert "cannot write" in one_line_error(stderr)
        assert not (out / "tp2" / "events.jsonl").exists()  # no index: TP=2 can never read as complete
        assert not (out / "tp2" / "rank0.done").exists()
        _no_half_files(out)
        from tpdiag.gate import evaluate

        assert evaluate(str(out)).exit_code == 2
        assert_no_orphans(tag)
    finally:
        _umount(mnt)


# -- interrupted or killed compare -------------------------------------------------------------
def _wait_for_ranks(tag: str, out, n: int, timeout: float = 120) -> None:
    """Until n processes are up: the CLI, multiprocessing's resource tracker, the fork server, ranks."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if len(tagged(tag)) >= n and (out / "manifest.json").exists():
            return
        time.sleep(0.2)
    raise AssertionError(f"compare never started its ranks: {tagged(tag)}")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=["SIGINT", "SIGTERM", "SIGKILL"])
def test_interrupted_compare_kills_its_ranks_and_reads_as_incomplete(targets, tmp_path, sig):
    from tpdiag.cli import app

    tag = uuid.uuid4().hex
    out = tmp_path / "run"
    # The reference's rank hangs: the compare is mid-run for as long as the test needs.
    p = start("compare", "--model", f"py:{targets}:plain_target", "--tp", "1,2", *SMALL, "--out", str(out),
              "--timeout", "300", tag=tag, env={"TPDIAG_FAULT": "hang:0@1", "PYTHONFAULTHANDLER": "1"})
    try:
        _wait_for_ranks(tag, out, 4)
        time.sleep(0.5)
        p.send_signal(sig)
        rc, stdout, stderr = finish(p, timeout=60, tag=tag)
    finally:
        if p.poll() is None:
            p.kill()
        if tagged(tag):
            assert_no_orphans(tag)  # fails the test, then cleans up
    if sig != signal.SIGKILL:
        assert rc == 130, stderr[-2000:]
        assert "interrupted" in stderr and "Traceback" not in stderr + stdout
    assert_no_orphans(tag)
    assert not (out / "summary.json").exists()
    r = CliRunner().invoke(app, ["gate", str(out)])
    assert r.exit_code == 2, r.output
    assert r.output.startswith("gate: INCONCLUSIVE") and "incomplete run" in r.output.splitlines()[0]
    r = CliRunner().invoke(app, ["report", str(out), "-o", str(tmp_path / "r.html")])
    assert r.exit_code == 2 and "incomplete run" in r.output, r.output
    assert "Traceback" not in r.output and not (tmp_path / "r.html").exists()


def test_stale_summary_of_an_earlier_run_is_not_trusted(plain_copy):
    """A compare interrupted while rewriting a directory leaves the old summary.json: the manifest
    (written first, finished last) says the new run is incomplete and the gate does not pass it."""
    from tpdiag.base import files as io
    from tpdiag.gate import evaluate

    m = io.read_json(str(plain_copy / "manifest.json"))
    del m["status"]
    m["worlds"] = {"1": m["worlds"]["1"]}
    io.write_json(str(plain_copy / "manifest.json"), m)
    res = evaluate(str(plain_copy))
    assert res.exit_code == 2 and "incomplete run" in res.problems[0] and "TP=1 ok" in res.problems[0]


# -- truncated or edited records ---------------------------------------------------------------
@pytest.mark.parametrize("damage", ["safetensors-truncated", "safetensors-header", "events-edited",
                                    "events-retyped", "world-not-object", "csv-module-renamed"])
def test_truncated_or_edited_records_are_inconclusive(plain_copy, damage):
    from tpdiag.cli import app
    from tpdiag.errors import Inconclusive
    from tpdiag.records.store import RecordSet

    tp2 = plain_copy / "tp2"
    st = tp2 / "records.safetensors"
    if damage == "safetensors-truncated":
        with open(st, "r+b") as f:
            f.truncate(os.path.getsize(st) - 7)
    elif damage == "safetensors-header":
        data = bytearray(st.read_bytes())
        i = data.index(b'"shape":[') + len(b'"shape":[')
        data[i] = ord("7") if data[i] != ord("7") else ord("5")  # a record claims another size
        st.write_bytes(bytes(data))
    elif damage == "events-edited":
        lines = (tp2 / "events.jsonl").read_text().splitlines()
        e = json.loads(lines[3])
        e["local_shape"] = [n + 1 for n in e["local_shape"]]
        lines[3] = json.dumps(e)
        (tp2 / "events.jsonl").write_text("\n".join(lines) + "\n")
    elif damage == "events-retyped":
        lines = (tp2 / "events.jsonl").read_text().splitlines()
        e = json.loads(lines[2])
        del e["kind"]
        lines[2] = json.dumps(e)
        (tp2 / "events.jsonl").write_text("\n".join(lines) + "\n")
    elif damage == "world-not-object":
        (tp2 / "world.json").write_text("[2]\n")
    else:
        fd = json.loads((plain_copy / "summary.json").read_text())["degrees"]["2"]["first_divergence"]
        text = (plain_copy / "diff.csv").read_text().replace(f",{fd['module']},", ",renamed,")
        (plain_copy / "diff.csv").write_text(text)
    if damage != "csv-module-renamed":
        with pytest.raises(Inconclusive):
            rs = RecordSet(str(tp2))
            for m in rs.events:
                rs.tensor(m)
    r = CliRunner().invoke(app, ["gate", str(plain_copy)])
    assert r.exit_code == 2, r.output
    assert r.output.startswith("gate: INCONCLUSIVE") and "Traceback" not in r.output
    r = CliRunner().invoke(app, ["report", str(plain_copy), "-o", str(plain_copy / "r.html")])
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception
    assert r.exit_code in (0, 2) and "Traceback" not in r.output


def make_capture(out, targets_path: str, perturb: float = 0.0) -> None:
    """An in-process TP=1 capture (tpdiag.capture, no torch.distributed) of the plain target:
    one forward, loss, backward and SGD step. perturb: added to fc2's output (a divergence)."""
    import importlib.util

    import torch
    import torch.nn.functional as F

    import tpdiag

    spec = importlib.util.spec_from_file_location("tpdiag_fault_targets", targets_path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    torch.manual_seed(1234)
    t = mod.plain_target()
    model = t.model
    g = torch.Generator().manual_seed(1235)
    ids = torch.randint(0, mod.VOCAB, (2, 8), generator=g)
    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
    hook = model.fc2.register_forward_hook(lambda m, i, o: o + perturb) if perturb else None
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with tpdiag.capture(model, out=str(out), plan=t.plan, seed=1234) as cap:
        cap.batch(input_ids=ids, labels=labels)
        logits = model(ids)
        cap.logprobs(torch.log_softmax(logits, -1).gather(-1, labels.clamp_min(0)[..., None])[..., 0])
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        cap.loss(loss)
        loss.backward()
        opt.step()
        cap.params()
    if hook is not None:
        hook.remove()


@pytest.mark.parametrize("damage", ["truncated", "events-truncated", "manifest-garbage", "manifest-shape"])
def test_diff_of_damaged_capture_is_exit_2(targets, tmp_path, damage):
    from tpdiag.cli import app

    a, b = tmp_path / "a", tmp_path / "b"
    make_capture(a, targets)
    make_capture(b, targets)
    r = CliRunner().invoke(app, ["diff", str(a), str(b), "--out", str(tmp_path / "d0"), "--format", "json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["status"] == "bitwise", r.output
    if damage == "truncated":
        st = b / "records.safetensors"
        with open(st, "r+b") as f:
            f.truncate(os.path.getsize(st) // 3)
    elif damage == "events-truncated":
        text = (b / "events.jsonl").read_text()
        (b / "events.jsonl").write_text(text[: len(text) // 2])
    elif damage == "manifest-garbage":
        (b / "manifest.json").write_bytes(b"\x89PNG\r\n\x1a\n" + os.urandom(64))
    else:
        m = json.loads((b / "manifest.json").read_text())
        m["model"] = ["not", "an", "object"]
        (b / "manifest.json").write_text(json.dumps(m))
    r = CliRunner().invoke(app, ["diff", str(a), str(b), "--out", str(tmp_path / "d1")])
    assert r.exit_code == 2, (r.output, r.exception)
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    line = one_line_error(r.output)
    assert line.startswith("error:") and str(b) in line, line


# -- untrusted inputs never run code (docs/security.md) ----------------------------------------
class _Payload:
    """Unpickling this creates a file: evidence that something unpickled it."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_run_directory_files_are_never_unpickled(plain_copy, tmp_path):
    import pickle

    import torch

    from tpdiag.cli import app
    from tpdiag.errors import Inconclusive
    from tpdiag.records.store import RecordSet

    marker = tmp_path / "UNPICKLED"
    tp2 = plain_copy / "tp2"
    (tp2 / "records.safetensors").write_bytes(pickle.dumps(_Payload(str(marker))))
    with pytest.raises(Inconclusive):
        RecordSet(str(tp2))
    torch.save({"x": _Payload(str(marker))}, str(tp2 / "records.safetensors"))  # a torch.save zip
    with pytest.raises(Inconclusive):
        RecordSet(str(tp2))
    (plain_copy / "summary.json").write_bytes(pickle.dumps(_Payload(str(marker))))
    for cmd in (["gate", str(plain_copy)], ["report", str(plain_copy), "-o", str(tmp_path / "r.html")]):
        r = CliRunner().invoke(app, cmd)
        assert r.exit_code == 2, r.output
    assert not marker.exists()


def test_hf_model_with_custom_code_is_refused_without_running_it(tmp_path):
    """An hf: directory whose config asks for its own Python code (auto_map): transformers is not
    allowed to run it (tpdiag never passes trust_remote_code=True); the spec is refused."""
    pytest.importorskip("transformers")
    from tpdiag.errors import BadInput
    from tpdiag.models.hf import load_model

    marker = tmp_path / "CODE_RAN"
    d = tmp_path / "custom"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "model_type": "tpdiag-test-custom", "architectures": ["CustomModel"], "vocab_size": 16,
        "auto_map": {"AutoConfig": "configuration_custom.CustomConfig",
                     "AutoModelForCausalLM": "modeling_custom.CustomModel"}}))
    payload = f"open({str(marker)!r}, 'w').write('ran')\n"
    (d / "configuration_custom.py").write_text(
        payload + "from transformers import PretrainedConfig\n\n\nclass CustomConfig(PretrainedConfig):\n"
                  "    model_type = 'tpdiag-test-custom'\n")
    (d / "modeling_custom.py").write_text(payload)
    with pytest.raises(BadInput, match="custom code"):
        load_model(str(d))
    assert not marker.exists()


def test_report_escapes_strings_from_the_run_directory(plain_copy, tmp_path):
    from tpdiag.cli import app

    evil = "<script>alert('tpdiag')</script>"
    s = json.loads((plain_copy / "summary.json").read_text())
    s["error"] = evil
    s["degrees"]["2"]["first_divergence"]["detail"] = evil
    (plain_copy / "summary.json").write_text(json.dumps(s))
    m = json.loads((plain_copy / "manifest.json").read_text())
    m["model"] = evil
    (plain_copy / "manifest.json").write_text(json.dumps(m))
    r = CliRunner().invoke(app, ["report", str(plain_copy), "-o", str(tmp_path / "r.html")])
    # a manifest whose model is not the one its worlds ran is an edited run (exit 2); the page is still
    # written, and it is the escaping of what it shows that this checks
    assert r.exit_code == 2 and "edited after the run" in r.output, r.output
    html = (tmp_path / "r.html").read_text()
    assert "alert(&#39;tpdiag&#39;)" in html or "alert('tpdiag')" not in html
    assert evil not in html
