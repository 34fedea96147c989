"""Fuzzing (hypothesis): the CLI's argument checking of `compare`, and every reader of a run
directory on truncated, bit-flipped, garbage or reshaped files.

Properties:
- `tpdiag compare` with bad arguments: exit 2 (3: environment) with exactly one line on stderr,
  never a traceback, nothing written. No world ever starts: `compare_session` / `run_matrix` are
  replaced by a tripwire, so an input that passes validation ends the example with code 99
  (valid input) instead of launching processes.
- Run-directory readers (RecordSet, io.read_json/read_jsonl, gate.evaluate, `tpdiag report`,
  `tpdiag diff`) on damaged files: a result, or a tpdiag.errors error (exit 2) - never another
  exception type, never a hang (a per-example alarm), and the gate never turns a failing run
  into a pass.

The base run is two in-process captures (tpdiag.capture, TP=1, no processes) and their
`tpdiag diff`; a second run holds a divergence so the gate's verdict on it is FAIL (exit 4: a sharding-bug).
Whole file: well under a minute (max_examples and deadlines below; derandomized for CI).
"""
from __future__ import annotations

import contextlib
import io as _io
import json
import os
import random
import shutil
import signal
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from test_faults_more import make_capture, write_targets

# The deadlines catch a hang, not slowness (speed is the benchmarks' business): on the shared 2-core
# machine one argument check took 6.4 s under load against a 2 s deadline, a red run for nothing.
FAST = settings(max_examples=150, deadline=30000, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
READERS = settings(max_examples=120, deadline=30000, derandomize=True, database=None,
                   suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
SLOW = settings(max_examples=15, deadline=60000, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

WOULD_RUN = 99


@contextlib.contextmanager
def no_hang(seconds: float = 30.0):
    """Fail (instead of hanging the suite) if one example takes longer than `seconds`."""
    def on_alarm(signum, frame):
        raise TimeoutError(f"hung for {seconds} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@pytest.fixture()
def tripwire(monkeypatch):
    """Valid arguments would start worlds: end the command there instead (exit code 99)."""
    def would_run(*a, **k):
        raise SystemExit(WOULD_RUN)

    import tpdiag.runner.matrix
    import tpdiag.runner.session

    monkeypatch.setattr(tpdiag.runner.session, "compare_session", would_run)
    monkeypatch.setattr(tpdiag.runner.matrix, "run_matrix", would_run)


def via_main(args: list[str]) -> tuple[int, str, str]:
    """The console entry point (tpdiag.cli:main) in-process: exit code, stdout, stderr."""
    from tpdiag.cli import main

    out, err = _io.StringIO(), _io.StringIO()
    argv = sys.argv
    sys.argv = ["tpdiag", *args]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), no_hang():
            main()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    finally:
        sys.argv = argv
    return code, out.getvalue(), err.getvalue()


def via_runner(args: list[str]):
    from tpdiag.cli import app

    with no_hang():
        return CliRunner().invoke(app, args)


def assert_one_line_error(code: int, out: str, err: str, args) -> None:
    assert code in (2, 3), (code, args, out, err)
    assert "Traceback" not in out + err, (args, err)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), (args, err)
    assert out.strip() == "", (args, out)


# -- compare: argument fuzzing -------------------------------------------------------------------
JUNK = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=12)
DIGITS = st.text(alphabet="0123456789,-+ x.e_", max_size=10)
NONPOS = st.integers(-10**12, 0).map(str)


def _opt(name, strategy):
    return strategy.map(lambda v: (name, v))


@st.composite
def compare_args(draw, tmp):
    hf_bad = draw(st.sampled_from(["missing", "json", "list", "heads"]))
    models = st.one_of(
        st.sampled_from(["nope", "hf:", "hf:/nonexistent/dir", "py:", "py:x", "py:missing.py:f",
                         "py:a.py:1bad", "py::f", "Tiny-Llama", "tiny_llama", f"hf:{tmp}/hf-{hf_bad}"]),
        JUNK.filter(lambda s: not s.startswith(("py:", "hf:")) and s.strip() not in
                    ("tiny-llama", "medium-llama", "llama-1b")))
    opts = [
        _opt("--tp", st.one_of(DIGITS, st.sampled_from(["", ",", "1", "1,", "0,1", "1,3", "-1,2", "1,2,x",
                                                        "1,2,,4", "2**3,1", "1;2"]), JUNK)),
        _opt("--dtype", st.one_of(st.sampled_from(["float13", "fp64", "int8", "", "FLOAT 32"]), JUNK)),
        _opt("--device", st.one_of(st.sampled_from(["gpu", "tpu", "cuda:0", "", "cpu "]), JUNK)),
        _opt("--format", st.one_of(st.sampled_from(["xml", "yaml", "JSON ", ""]), JUNK)),
        _opt("--steps", st.one_of(NONPOS, NONPOS, JUNK, st.sampled_from(["1.5", "1e3", "0x10", ""]))),
        _opt("--timeout", st.one_of(st.floats(max_value=0, allow_nan=False).map(repr), JUNK,
                                    st.sampled_from(["0", "-1", "abc", "1s", ""]))),
        _opt("--batch-size", st.one_of(NONPOS, NONPOS, JUNK)),
        _opt("--seq-len", st.one_of(st.integers(-10**6, 1).map(str), JUNK)),
        _opt("--seed", st.one_of(JUNK.filter(lambda s: not s.strip().lstrip("+-").isdigit()))),
        _opt("--model", models),
        _opt("--fix", st.one_of(st.sampled_from(["magic", "all,magic", "tp-invariant", ",", "auto,all"]), JUNK)),
        _opt("--granularity", st.one_of(st.sampled_from(["ops", "modules", ""]), JUNK)),
        _opt("--variant", st.one_of(st.sampled_from(["stabel", "", "fix:all"]), JUNK)),
        _opt("--variants", st.one_of(st.sampled_from(["", ",", "stock,stock", "fix:magic", "stable+", "x:y",
                                                      "stock,,stable", "fix:"]), JUNK)),
        _opt("--out", st.sampled_from([f"{tmp}/a-file"])),
    ]
    # A few options per example (in any order): with many, click's own type check of the first
    # bad integer would end almost every example before tpdiag's validation is reached.
    picked = draw(st.lists(st.sampled_from(range(len(opts))), min_size=1, max_size=3, unique=True))
    chosen = [o for o in (draw(opts[i]) for i in picked) if o is not None]
    flags = draw(st.lists(st.sampled_from(["--forward-only", "--no-confirm", "--no-baseline",
                                           "--fail-on-divergence", "--bogus", "-x"]), max_size=1)
                 if draw(st.integers(0, 9)) == 0 else st.just([]))
    args = ["compare"]
    for k, v in chosen:
        args += [k, v]
    return args + flags


@pytest.fixture(scope="module")
def cli_tmp(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cli")
    (tmp / "a-file").write_text("not a directory\n")
    for name, text in (("json", "{not json"), ("list", "[1, 2]"),
                       ("heads", json.dumps({"num_attention_heads": 3, "vocab_size": 7}))):
        (tmp / f"hf-{name}").mkdir()
        (tmp / f"hf-{name}" / "config.json").write_text(text)
    return tmp


# Known, reported to the owner of tpdiag/models/spec.py: an hf: directory whose config.json is not
# a JSON object ends in a JSONDecodeError/AttributeError (one line via `main`, exit 2, but not a
# typed error). Kept out of the fuzz property; test_hf_config_not_json_is_bad_input tracks it.
_KNOWN_UNTYPED = ("hf-json", "hf-list")


@FAST
@given(data=st.data())
def test_compare_bad_arguments_one_line_exit_2(data, cli_tmp, tripwire):
    args = data.draw(compare_args(str(cli_tmp)))
    out_dir = cli_tmp / "never"
    args += ["--out", str(out_dir)] if "--out" not in args else []
    code, out, err = via_main(args)
    if code == WOULD_RUN:
        return  # passed validation: would have run (no world started)
    if any(k in a for a in args for k in _KNOWN_UNTYPED) and "Error:" in err:
        return
    assert_one_line_error(code, out, err, args)
    assert not out_dir.exists()
    r = via_runner(args)
    assert r.exit_code == code, (args, r.output, r.exception)
    assert isinstance(r.exception, SystemExit) or r.exception is None, (args, repr(r.exception))
    assert "Traceback" not in r.output


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e400", "1e300"])
def test_non_finite_or_absurd_timeout_is_rejected_in_one_line(value, tmp_path):
    """Click accepts 'nan' and 'inf' as floats; validate() does not reject them (owner: runner/compare.py),
    so run_world does, before any rank starts: one line, exit 2."""
    code, out, err = via_main(["compare", "--model", "tiny-llama", "--tp", "1,2", "--no-confirm", "--no-baseline",
                               "--device", "cpu", "--timeout", value, "--format", "json",
                               "--out", str(tmp_path / "r")])
    assert_one_line_error(code, out, err, value)
    assert "--timeout" in err
    assert not any(f.startswith("rank") for _, _, fs in os.walk(tmp_path) for f in fs)


@pytest.mark.parametrize("name", ["json", "list"])
def test_hf_config_not_json_is_bad_input(name, cli_tmp, tripwire):
    r = via_runner(["compare", "--model", f"hf:{cli_tmp}/hf-{name}", "--tp", "1,2", "--out", str(cli_tmp / "n")])
    assert r.exit_code == 2 and isinstance(r.exception, SystemExit), repr(r.exception)


# -- run-directory readers -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """Captures A (reference), B (equal to A) and C (fc2 output nudged: divergent), and two
    `tpdiag diff` run directories: A-B (bitwise, gate exit 0) and A-C (divergent far beyond rounding: a
    sharding-bug, gate exit 4)."""
    from tpdiag.diff.runs import diff_runs
    from tpdiag.gate import evaluate

    root = tmp_path_factory.mktemp("fuzz")
    targets = write_targets(root)
    make_capture(root / "A", targets)
    make_capture(root / "B", targets)
    make_capture(root / "C", targets, perturb=1e-3)
    diff_runs(str(root / "A"), str(root / "B"), str(root / "AB"))
    diff_runs(str(root / "A"), str(root / "C"), str(root / "AC"))
    got = {d: evaluate(str(root / d)) for d in ("AB", "AC")}
    verdict = {d: r.exit_code for d, r in got.items()}
    assert verdict == {"AB": 0, "AC": 4}, {d: (r.exit_code, r.problems) for d, r in got.items()}
    files = sorted(os.path.relpath(os.path.join(dp, f), root) for dp, _, fs in os.walk(root) for f in fs
                   if not f.endswith(".py"))
    return root, files, verdict


def _json_values():
    return st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-3, 10**12), st.floats(allow_nan=False),
                                  st.text(max_size=6)),
                        lambda c: st.one_of(st.lists(c, max_size=3), st.dictionaries(st.text(max_size=5), c, max_size=3)),
                        max_leaves=6)


def _paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, prefix + (i,))


def _reshape_json(obj, rnd: random.Random, new_value, drop: bool):
    """Replace (or delete) one randomly chosen node of a parsed JSON document."""
    paths = list(_paths(obj))
    path = paths[rnd.randrange(len(paths))]
    if not path:
        return new_value
    parent = obj
    for k in path[:-1]:
        parent = parent[k]
    if drop:
        del parent[path[-1]]
    else:
        parent[path[-1]] = new_value
    return obj


@st.composite
def damage(draw, files):
    name = draw(st.sampled_from(files))
    kind = draw(st.sampled_from(["truncate", "flip", "garbage", "empty", "delete", "reshape", "reshape", "splice"]))
    return name, kind, draw(st.randoms(use_true_random=False)), draw(_json_values()), draw(st.booleans())


def _apply(path: str, kind: str, rnd: random.Random, value, drop: bool) -> None:
    data = open(path, "rb").read()
    if kind == "truncate":
        data = data[: rnd.randrange(len(data) + 1)] if data else data
    elif kind == "flip":
        b = bytearray(data)
        for _ in range(rnd.choice([1, 1, 2, 8])):
            if b:
                b[rnd.randrange(len(b))] ^= 1 << rnd.randrange(8)
        data = bytes(b)
    elif kind == "garbage":
        data = bytes(rnd.randrange(256) for _ in range(rnd.choice([1, 7, 64, 4096])))
    elif kind == "empty":
        data = b""
    elif kind == "delete":
        os.unlink(path)
        return
    elif kind == "splice":  # a chunk of the file repeated (a write that went wrong)
        if data:
            i = rnd.randrange(len(data))
            data = data[:i] + data[i:i + rnd.randrange(1, 512)] + data[i:]
    else:  # reshape: valid JSON of the wrong shape
        if path.endswith(".jsonl"):
            lines = data.decode().splitlines()
            i = rnd.randrange(len(lines))
            lines[i] = json.dumps(_reshape_json(json.loads(lines[i]), rnd, value, drop))
            data = ("\n".join(lines) + "\n").encode()
        elif path.endswith(".json"):
            data = json.dumps(_reshape_json(json.loads(data), rnd, value, drop)).encode()
        elif path.endswith(".csv"):
            lines = data.decode().splitlines()
            i = rnd.randrange(len(lines))
            cells = lines[i].split(",")
            cells[rnd.randrange(len(cells))] = json.dumps(value)[:12].replace(",", ";")
            lines[i] = ",".join(cells)
            data = ("\n".join(lines) + "\n").encode()
        else:  # safetensors: reshape its JSON header
            import struct

            n = struct.unpack("<Q", data[:8])[0]
            header = _reshape_json(json.loads(data[8:8 + n]), rnd, value, drop)
            h = json.dumps(header).encode()
            data = struct.pack("<Q", len(h)) + h + data[8 + n:]
    with open(path, "wb") as f:
        f.write(data)


@contextlib.contextmanager
def damaged(root, name, kind, rnd, value, drop):
    """Damage one file of the shared base run, restore it afterwards (the manifests of `tpdiag diff`
    name the captures by absolute path, so the tree is edited in place, not copied)."""
    path = os.path.join(root, name)
    original = open(path, "rb").read()
    try:
        _apply(path, kind, rnd, value, drop)
        yield path
    finally:
        with open(path, "wb") as f:
            f.write(original)


def _typed_or_result(fn, *a):
    """Call a library reader: a result or a tpdiag error, nothing else."""
    from tpdiag.errors import TpdiagError

    try:
        with no_hang():
            return fn(*a)
    except TpdiagError as e:
        assert str(e).strip() and "\n" not in str(e).strip(), repr(str(e))
        return e


@READERS
@given(data=st.data())
def test_readers_fail_typed_and_gate_never_passes_damaged_evidence(data, base):
    from tpdiag.base import files as io
    from tpdiag.gate import evaluate
    from tpdiag.records.store import RecordSet

    root, files, verdict = base
    name, kind, rnd, value, drop = data.draw(damage(files))
    with damaged(root, name, kind, rnd, value, drop) as path:
        if path.endswith(".jsonl"):
            _typed_or_result(io.read_jsonl, path)
        elif path.endswith(".json"):
            _typed_or_result(io.read_json, path)
        for cap in ("A", "B", "C"):
            rs = _typed_or_result(RecordSet, str(root / cap))
            if isinstance(rs, RecordSet):
                for m in rs.events:
                    _typed_or_result(rs.tensor, m)
        for run in ("AB", "AC"):
            with no_hang():
                res = evaluate(str(root / run))  # never raises
            assert res.exit_code in (verdict[run], 2), (name, kind, run, res.lines())
            if res.exit_code == 2:
                assert res.problems and all("\n" not in p for p in res.problems), res.problems
            json.loads(json.dumps(res.to_dict(), default=str), parse_constant=lambda c: 1 / 0)


@SLOW
@given(data=st.data())
def test_report_and_diff_commands_on_damaged_runs(data, base, tmp_path):
    root, files, verdict = base
    name, kind, rnd, value, drop = data.draw(damage(files))
    out = tmp_path / "out"
    with damaged(root, name, kind, rnd, value, drop):
        r = via_runner(["report", str(root / "AC"), "-o", str(tmp_path / "r.html")])
        assert isinstance(r.exception, SystemExit) or r.exception is None, (name, kind, repr(r.exception))
        assert r.exit_code in (0, 2) and "Traceback" not in r.output, (name, kind, r.output)
        if r.exit_code == 2:
            assert len([ln for ln in r.output.splitlines() if ln.strip()]) == 1, r.output
        r = via_runner(["diff", str(root / "A"), str(root / "C"), "--out", str(out), "--format", "json"])
        assert isinstance(r.exception, SystemExit) or r.exception is None, (name, kind, repr(r.exception))
        assert r.exit_code in (0, 2) and "Traceback" not in r.output, (name, kind, r.output)
    shutil.rmtree(out, ignore_errors=True)


def test_gate_cli_on_garbage_run_dirs(tmp_path):
    """Directories that are not run directories at all: one line or an INCONCLUSIVE verdict, exit 2."""
    cases = {"empty": {}, "files-are-dirs": None, "binary": {"manifest.json": os.urandom(100),
                                                            "summary.json": b"\xff\xfe{}"},
             "wrong-shapes": {"manifest.json": b"[]", "summary.json": b'{"degrees": [1, 2]}', "diff.csv": b"a,b\n1,2\n"},
             "deep": {"manifest.json": b"[" * 100000 + b"]" * 100000, "summary.json": b"{}"}}
    for name, files in cases.items():
        d = tmp_path / name
        d.mkdir()
        if files is None:
            for f in ("manifest.json", "summary.json", "diff.csv"):
                (d / f).mkdir()
        else:
            for f, b in files.items():
                (d / f).write_bytes(b)
        for cmd in (["gate", str(d)], ["report", str(d), "-o", str(tmp_path / "x.html")]):
            code, out, err = via_main(cmd)
            assert code == 2, (name, cmd, out, err)
            assert "Traceback" not in out + err
            text = err if err.strip() else out
            assert text.strip(), (name, cmd)
            if cmd[0] == "report" or err.strip():
                assert len([ln for ln in err.splitlines() if ln.strip()]) == 1, (name, cmd, err)
