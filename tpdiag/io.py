"""Atomic writes (temp file + fsync + rename) and safe reads. JSON, CSV and safetensors only: no pickle."""
from __future__ import annotations

import json
import os
import tempfile

from tpdiag.errors import Inconclusive


_UMASK = os.umask(0)
os.umask(_UMASK)


def _atomic(path: str, write) -> None:
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=d)
    try:
        os.chmod(tmp, 0o644 & ~_UMASK)
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def write_bytes(path: str, data: bytes) -> None:
    _atomic(path, lambda f: f.write(data))


def write_json(path: str, obj) -> None:
    write_bytes(path, (json.dumps(obj, indent=2, sort_keys=False, default=_json_default) + "\n").encode())


def write_jsonl(path: str, rows) -> None:
    write_bytes(path, "".join(json.dumps(r, default=_json_default) + "\n" for r in rows).encode())


def write_safetensors(path: str, tensors: dict, metadata: dict | None = None) -> None:
    from safetensors.torch import save

    data = save(tensors, metadata=metadata)
    write_bytes(path, data)


def read_json(path: str):
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise Inconclusive(f"{path}: missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise Inconclusive(f"{path}: corrupt JSON ({e})") from None


def read_jsonl(path: str) -> list:
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        raise Inconclusive(f"{path}: missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise Inconclusive(f"{path}: corrupt JSON lines ({e})") from None


def _json_default(o):
    if hasattr(o, "to_dict"):
        return o.to_dict()
    if isinstance(o, (set, tuple)):
        return list(o)
    return str(o)
