"""A copy of a module with one piece of its source replaced, loaded under another name: how the
negative controls run a kernel without its fix (the subprocess scripts of
test_invariant_attention.py and test_attention_offsets.py, run from the repository root)."""
import importlib.util
import pathlib
import sys
import tempfile


def patched(module, old: str, new: str, name: str):
    src = pathlib.Path(module.__file__).read_text()
    assert src.count(old) == 1, f"{old!r} occurs {src.count(old)} times in {module.__file__}"
    path = pathlib.Path(tempfile.mkdtemp()) / f"{name}.py"
    path.write_text(src.replace(old, new))
    spec = importlib.util.spec_from_file_location(name, path)
    mod = sys.modules[name] = importlib.util.module_from_spec(spec)  # dataclasses look it up there
    spec.loader.exec_module(mod)
    return mod
