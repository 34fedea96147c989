"""The package's import rules, read from the code with ast (module- and function-level imports).

probes never import diff; diff never imports runner; reports never import runner or gate;
fixes and kernels import nothing of probes, diff, runner, the CLI or the public API; records
imports nothing of probes, diff or runner; nothing below the CLI imports it; tpdiag/base/ imports
no other package; no module outside records (and base's file I/O) reads record files; no import
circles (a package __init__ re-exporting its own modules aside).
"""
import ast
import os

import pytest

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tpdiag")

# the rooms: cli (the command) -> api (the public Python API) and runner -> models, probes,
# fixes/kernels; probes write records, diff/gate/reports read them; base is the floor.
BELOW_ALL = {"cli", "api", "runner", "rollout", "models", "probes", "fixes", "kernels", "diff", "gate",
             "reports", "records"}
FORBIDDEN = {
    "probes": {"diff", "cli", "api"},
    "diff": {"runner", "cli", "api"},
    "reports": {"runner", "gate", "cli", "api"},
    "fixes": {"probes", "diff", "runner", "cli", "api"},
    "kernels": {"probes", "diff", "runner", "cli", "api"},
    "records": {"probes", "diff", "runner", "cli", "api"},
    "api": {"cli"},
    "base": BELOW_ALL,
}


def _modules(root: str) -> dict[str, str]:
    mods = {}
    for d, _, files in os.walk(root):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(d, f)
                name = "tpdiag." + os.path.relpath(path, root)[:-3].replace(os.sep, ".")
                mods[name.removesuffix(".__init__")] = path
    return mods


def _imports(path: str, me: str, mods: dict[str, str]) -> set[str]:
    is_pkg = path.endswith("__init__.py")
    out = set()
    for n in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(n, ast.Import):
            out |= {a.name for a in n.names}
        elif isinstance(n, ast.ImportFrom):
            base = n.module or ""
            if n.level:
                parts = me.split(".")
                parts = parts[: len(parts) - n.level + (1 if is_pkg else 0)]
                base = ".".join(parts + ([base] if base else []))
            out.add(base)
            out |= {f"{base}.{a.name}" for a in n.names}
    # "import tpdiag.diff.engine" also names tpdiag.diff; keep the most specific module known
    return {m for m in out if m in mods}


def graph(root: str = ROOT) -> tuple[dict[str, set[str]], dict[str, str]]:
    mods = _modules(root)
    return {m: _imports(p, m, mods) for m, p in mods.items()}, mods


def _area(m: str) -> str:
    parts = m.split(".")
    return parts[1] if len(parts) > 1 else ""


def broken_layers(g: dict[str, set[str]]) -> list[str]:
    bad = []
    for m, deps in sorted(g.items()):
        for d in sorted(deps):
            if _area(d) in FORBIDDEN.get(_area(m), ()):
                bad.append(f"{m} imports {d} ({_area(m)} must not import {_area(d)})")
    return bad


def circles(g: dict[str, set[str]], mods: dict[str, str]) -> list[list[str]]:
    def real(a: str, b: str) -> bool:
        # a package __init__ re-exporting its own modules (or a module importing its package) is no circle
        return not ((mods[b].endswith("__init__.py") and a.startswith(b + "."))
                    or (mods[a].endswith("__init__.py") and b.startswith(a + ".")))

    found, state, stack = [], {}, []

    def visit(v: str) -> None:
        state[v] = 1
        stack.append(v)
        for w in sorted(g[v]):
            if not real(v, w):
                continue
            if state.get(w) == 1:
                found.append(stack[stack.index(w):] + [w])
            elif w not in state:
                visit(w)
        stack.pop()
        state[v] = 2

    for v in sorted(g):
        if v not in state:
            visit(v)
    return found


def test_layers_hold():
    g, _ = graph()
    assert broken_layers(g) == []


def test_no_import_circles():
    g, mods = graph()
    assert circles(g, mods) == []


def test_record_format_lives_in_records():
    """RecordSet and the run-directory reader are defined in tpdiag/records/, nowhere else."""
    _, mods = graph()
    where = {name: [m for m, p in mods.items() if f"\n{kind} {name}" in "\n" + open(p).read()]
             for kind, name in (("class", "RecordSet"), ("def", "read_rows"), ("def", "load_run"))}
    assert all(ms and all(_area(m) == "records" for m in ms) for ms in where.values()), where


def test_only_records_reads_record_files():
    """No module outside tpdiag/records/ opens a degree's tensors or parses diff.csv."""
    _, mods = graph()
    readers = ("safe_open", "csv.DictReader", "csv.reader", "read_jsonl(")
    bad = [f"{m}: {r}" for m, p in mods.items() if _area(m) not in ("records", "base")
           for r in readers if r in open(p).read()]
    assert bad == []


@pytest.mark.parametrize("area, target, bad", [
    ("probes", "diff", True), ("records", "runner", True), ("reports", "gate", True),
    ("kernels", "cli", True), ("api", "cli", True), ("base", "records", True), ("diff", "records", False),
    ("gate", "diff", False), ("cli", "api", False)])
def test_checker_sees_a_forbidden_import(tmp_path, area, target, bad):
    """The checker itself: a copy of the package with one added import is (or is not) flagged."""
    import shutil

    root = tmp_path / "tpdiag"
    shutil.copytree(ROOT, root, ignore=shutil.ignore_patterns("__pycache__", "templates"))
    victim = next(p for p in sorted((root / area).glob("*.py")) if p.name != "__init__.py")
    mod = next(p.stem for p in sorted((root / target).glob("*.py")) if p.name != "__init__.py") \
        if (root / target).is_dir() else None
    line = f"\nfrom tpdiag.{target}{'.' + mod if mod else ''} import x  # noqa\n"
    victim.write_text(victim.read_text() + line)
    g, _ = graph(str(root))
    assert bool(broken_layers(g)) is bad


def test_checker_sees_a_circle(tmp_path):
    import shutil

    root = tmp_path / "tpdiag"
    shutil.copytree(ROOT, root, ignore=shutil.ignore_patterns("__pycache__", "templates"))
    (root / "fixes" / "state.py").write_text((root / "fixes" / "state.py").read_text()
                                             + "\nfrom tpdiag.fixes import catalogue  # noqa\n")
    g, mods = graph(str(root))
    assert any("tpdiag.fixes.state" in c for c in circles(g, mods))
