"""records/provenance.versions: the manifest's versions, Triton's read without importing it."""
from __future__ import annotations

import subprocess
import sys
import textwrap


def test_triton_version_without_importing_triton(tmp_path):
    """versions() names the installed Triton's __version__ and leaves Triton unimported (the import
    was 0.7-0.9 s of every compare pass's setup before its first world on a gloo host); where
    Triton is absent (None in sys.modules) it says None; where its __init__.py spells no literal it
    imports it, as before."""
    fake = tmp_path / "fake" / "triton"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text('__version__ = ".".join(["9", "9"])\n')
    code = textwrap.dedent(f"""
        import importlib, sys
        from tpdiag.records.provenance import versions
        v = versions("cpu")["triton"]
        print("imported" if "triton" in sys.modules else "not imported")
        import triton
        assert v == triton.__version__, (v, triton.__version__)
        for name in [n for n in sys.modules if n == "triton" or n.startswith("triton.")]:
            del sys.modules[name]
        sys.modules["triton"] = None
        assert versions("cpu")["triton"] is None
        del sys.modules["triton"]
        sys.path.insert(0, {str(fake.parent)!r})
        importlib.invalidate_caches()
        assert versions("cpu")["triton"] == "9.9"
        assert sys.modules["triton"].__file__.startswith({str(fake)!r})
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "not imported"
