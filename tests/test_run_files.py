"""summary.json and manifest.json have one writer (tpdiag/records/run_files.py, issue 62 item 5):
no other module of tpdiag/ writes either, and the writer assembles each file from its parts in
memory - a part is added to what was written, never to the file read back."""
from __future__ import annotations

import ast
import json
import os

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tpdiag")
OWNER = os.path.join("records", "run_files.py")
WRITERS = {"write_json", "write_bytes", "write_text", "dump"}
NAMES = {"summary", "manifest", "SUMMARY", "MANIFEST"}


def offences(source: str) -> list[str]:
    """Where `source` writes summary.json or manifest.json itself: a write call (or open(..., 'w'))
    whose path names RunDir(...).summary / .manifest or the SUMMARY / MANIFEST names."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        fn = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        mode = [a for a in node.args[1:2] if isinstance(a, ast.Constant)]
        if fn not in WRITERS and not (fn == "open" and mode and "w" in str(mode[0].value)):
            continue
        for arg in node.args[:1]:
            named = {n.attr for n in ast.walk(arg) if isinstance(n, ast.Attribute)} | \
                    {n.id for n in ast.walk(arg) if isinstance(n, ast.Name)}
            if named & NAMES:
                out.append(f"line {node.lineno}: {fn}(...{', '.join(sorted(named & NAMES))}...)")
    return out


def test_the_check_catches_what_it_forbids():
    """Negative control: each way of writing either file is caught; writes of other files and
    reads of these are not."""
    assert offences("io.write_json(RunDir(out).summary, s)\n")
    assert offences("io.write_json(run.manifest, m)\n")
    assert offences("io.write_json(os.path.join(out, MANIFEST), m)\n")
    assert offences("with open(RunDir(d).summary, 'w') as f:\n    json.dump(s, f)\n")
    assert not offences("io.write_json(RunDir(out).diff_csv, rows)\nm = io.read_json(RunDir(out).manifest)\n")
    assert not offences("write_summary(out, summary)\nfiles.add(status='ok')\n")


def test_only_run_files_writes_summary_and_manifest():
    found = []
    for d, _, files in os.walk(ROOT):
        for f in files:
            path = os.path.join(d, f)
            if f.endswith(".py") and os.path.relpath(path, ROOT) != OWNER:
                with open(path) as fh:
                    found += [f"{os.path.relpath(path, ROOT)} {o}" for o in offences(fh.read())]
    assert not found, "write summary.json / manifest.json through tpdiag/records/run_files.py:\n" + "\n".join(found)


def test_run_files_assembles_parts_without_reading_the_file_back(tmp_path):
    """Every part writes the whole file from memory: a manifest.json overwritten on disk between
    two parts (as a read-patch-write would then keep) comes back whole; the summary leaves out
    its in-memory keys and returns what it wrote."""
    from tpdiag.records.run_files import RunFiles

    files = RunFiles(tmp_path, {"tool": "tpdiag compare", "worlds": {}})
    assert json.loads((tmp_path / "manifest.json").read_text()) == {"tool": "tpdiag compare", "worlds": {}}
    files.world("1", {"status": "ok"})
    (tmp_path / "manifest.json").write_text('{"tool": "someone else"}')
    files.world("2", {"status": "failed"})
    files.add(phases={"diff_s": 1.0}, status="divergent")
    files.add(phases={"diff_s": 1.0, "compare_s": 2.0})
    m = json.loads((tmp_path / "manifest.json").read_text())
    assert m == {"tool": "tpdiag compare", "worlds": {"1": {"status": "ok"}, "2": {"status": "failed"}},
                 "phases": {"diff_s": 1.0, "compare_s": 2.0}, "status": "divergent"}
    assert list(m) == ["tool", "worlds", "phases", "status"]  # a replaced part keeps its place
    written = files.summary({"status": "divergent", "run_dir": str(tmp_path)})
    assert written == files.written == {"status": "divergent"}
    assert json.loads((tmp_path / "summary.json").read_text()) == {"status": "divergent"}
