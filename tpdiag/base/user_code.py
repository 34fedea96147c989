"""Which frames are the user's own code: not tpdiag's, torch's, transformers' or the standard
library's.

A rank's exception (runner/rank_errors.py) and a recorded op (probes/op_probe.py: `aten::mul` of
a module's own forward - which of its muls?) both point the user at the innermost such frame.
"""
from __future__ import annotations

import os
import sys
import sysconfig

_INTERNAL: list = []
_LIBS: list = []  # tpdiag's, torch's, transformers' own directories: internal wherever they sit
_SITE: list = []  # the installed packages' directories (site-packages): the user's, unless a lib above
_SEEN: dict = {}  # co_filename -> internal? (a walk per recorded op must not resolve paths again)


def internal_dirs() -> list[str]:
    if not _INTERNAL:
        import torch

        import tpdiag

        dirs = [os.path.dirname(tpdiag.__file__), os.path.dirname(torch.__file__)]
        try:
            import importlib.util

            spec = importlib.util.find_spec("transformers")
            if spec is not None and spec.origin:
                dirs.append(os.path.dirname(spec.origin))
        except (ImportError, ValueError):
            pass
        _LIBS.extend(os.path.realpath(d) + os.sep for d in dirs)
        # A pyenv (or any non-Debian) Python keeps site-packages INSIDE its stdlib directory
        # (lib/python3.X/site-packages): the stdlib prefix alone took every pip-installed package -
        # the user's own model package among them - for the standard library, and the op line
        # skipped it (red team hred15). Those directories are the user's, below the libs above.
        _SITE.extend(os.path.realpath(d) + os.sep for d in _site_dirs())
        for key in ("stdlib", "platstdlib"):
            p = sysconfig.get_paths().get(key)
            if p:
                dirs.append(p)
        _INTERNAL.extend(os.path.realpath(d) + os.sep for d in dirs)
    return _INTERNAL


def _site_dirs() -> list[str]:
    import site

    out = [sysconfig.get_paths().get(k) for k in ("purelib", "platlib")]
    try:
        out += site.getsitepackages() + [site.getusersitepackages()]
    except AttributeError:  # a virtualenv's old site.py has neither
        pass
    return sorted({d for d in out if d})


def shown(path: str) -> str:
    rel = os.path.relpath(path)
    return rel if not rel.startswith("..") else path


def _internal(filename: str) -> bool:
    hit = _SEEN.get(filename)
    if hit is None:
        hit = _SEEN[filename] = filename.startswith("<") or _internal_path(os.path.realpath(filename))
    return hit


def _internal_path(path: str) -> bool:
    dirs = internal_dirs()
    if any(path.startswith(d) for d in _LIBS):
        return True
    if any(path.startswith(d) for d in _SITE):
        return False  # an installed package: the user's code (their model package), not the stdlib
    return any(path.startswith(d) for d in dirs)


def _process_entry():
    from multiprocessing.process import BaseProcess

    return BaseProcess._bootstrap.__code__


def calling_line() -> str | None:
    """'FILE:LINE in FUNC' of the innermost frame of the running stack in the user's own code;
    None when there is none (an op of torch's or tpdiag's own, a library model)."""
    f = sys._getframe(1)
    stop = _process_entry()
    while f is not None:
        if f.f_code is stop:
            # below a child process's bootstrap lies the code that started it (a fork server's
            # loop, a test harness, the user's launcher) - never the op's origin
            return None
        if not _internal(f.f_code.co_filename):
            return f"{shown(f.f_code.co_filename)}:{f.f_lineno} in {f.f_code.co_name}"
        f = f.f_back
    return None
