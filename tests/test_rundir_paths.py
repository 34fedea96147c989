"""The run directory's names live in one place (tpdiag/records/paths.py RunDir, and the
configuration names in tpdiag/base/configs.py): no other module of tpdiag/ spells a run-directory
file name or builds a configuration's folder name `tp{...}` itself (issue 62 item 2)."""
from __future__ import annotations

import ast
import os

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tpdiag")
OWNERS = {os.path.join("records", "paths.py"), os.path.join("base", "configs.py")}
# report.html is also the report template's name (reports/templates/); the report's path goes through RunDir too
NAMES = {"manifest.json", "summary.json", "diff.csv", "world.json", "result.json"}


def _docstrings(tree) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = getattr(node, "body", [])
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
    return out


def offences(source: str) -> list[str]:
    """Where `source` names a run-directory file or builds a 'tp' + label name itself."""
    tree = ast.parse(source)
    docs = _docstrings(tree)
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            if node.value in NAMES:
                out.append(f"line {node.lineno}: the file name {node.value!r}")
        elif isinstance(node, ast.JoinedStr):
            parts = node.values
            for a, b in zip(parts, parts[1:]):
                if (isinstance(a, ast.Constant) and isinstance(a.value, str) and a.value.endswith("tp")
                        and isinstance(b, ast.FormattedValue)
                        and (len(a.value) == 2 or not a.value[-3].isalnum())):
                    out.append(f"line {node.lineno}: an f-string 'tp{{...}}'")
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            if isinstance(node.left, ast.Constant) and node.left.value == "tp":
                out.append(f"line {node.lineno}: 'tp' + ...")
    return out


def test_the_check_catches_what_it_forbids():
    """Negative control: each forbidden spelling is caught; the allowed ones are not."""
    assert offences('import os\np = os.path.join(d, f"tp{label}")\n')
    assert offences('p = "tp" + str(label)\n')
    assert offences('p = os.path.join(d, "summary.json")\n')
    assert offences('msg = f"{who}: tp{label}/x"\n')
    assert not offences('"""summary.json and tp{N} in a docstring"""\nx = f"http{a}"\n')
    assert not offences('x = RunDir(out).summary\n# os.path.join(out, "summary.json")\n')


def _modules():
    for d, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(d, f)
                yield os.path.relpath(path, ROOT), path


def test_no_module_spells_run_dir_names():
    found = []
    for rel, path in sorted(_modules()):
        if rel in OWNERS:
            continue
        with open(path, encoding="utf-8") as f:
            found += [f"tpdiag/{rel} {o}" for o in offences(f.read())]
    assert not found, "use tpdiag.records.paths.RunDir / tpdiag.base.configs:\n" + "\n".join(found)
