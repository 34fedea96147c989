"""runner/prefetch: the first diff's pandas import begun in a thread while the first worlds run."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap


def _run(code: str, **env) -> str:
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                       timeout=120, env={**os.environ, **env})
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout.strip()


def test_prefetch_imports_pandas_once_in_a_thread():
    out = _run("""
        import sys, threading
        from tpdiag.runner import prefetch
        assert "pandas" not in sys.modules
        t = prefetch.start()
        assert isinstance(t, threading.Thread) and t is not threading.current_thread() and not t.daemon
        t.join()
        assert "pandas" in sys.modules and sys.modules["pandas"].DataFrame
        print(prefetch.start())
    """)
    assert out == "None"  # begun once per process


def test_prefetch_off_imports_nothing():
    out = _run("""
        import sys
        from tpdiag.runner import prefetch
        print(prefetch.start(), "pandas" in sys.modules)
    """, TPDIAG_PREFETCH="0")
    assert out == "None False"
