"""Atomic writes (temp file + fsync + rename) and safe reads. JSON, CSV and safetensors only: no pickle."""
from __future__ import annotations

import json
import os
import tempfile

from tpdiag.errors import Inconclusive


_UMASK = os.umask(0)
os.umask(_UMASK)


class WriteError(Inconclusive, OSError):
    """A file could not be written (disk full, read-only, no permission): the run cannot be
    complete. Nothing half-written is left under the target name. Also an OSError, so callers
    that handle OSError keep working; `errno`/`strerror` are the original's."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "write failed"


def why_unwritable(path: str, e: OSError) -> str:
    """e's words, or where the path runs into a file: creating the folders of 'report/x.html'
    when 'report' is a file fails with EEXIST, 'File exists', which names no file."""
    d = os.path.dirname(os.path.abspath(path))
    while d and not os.path.lexists(d):
        d = os.path.dirname(d)
    if d and not os.path.isdir(d):
        return f"{d} is a file, not a directory"
    return str(e.strerror or e)


def _write_error(path: str, e: OSError) -> WriteError:
    err = WriteError(f"{path}: cannot write ({e.strerror or e})")
    err.errno, err.strerror = e.errno, e.strerror
    return err


def _atomic(path: str, write, sync: bool = True) -> None:
    """write(f) into a temp file renamed to path: a reader sees the whole file or none. sync=False
    skips the fsync (durability across a power loss, not atomicity): for record files of GBs, whose
    every tensor is hash-checked when read - a file the disk lost reads as edited, fail closed."""
    d = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(d, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=d)
    except OSError as e:
        raise _write_error(path, e) from None
    try:
        os.chmod(tmp, 0o644 & ~_UMASK)
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            if sync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(e, OSError) and not isinstance(e, WriteError):
            raise _write_error(path, e) from None
        raise


def write_bytes(path: str, data: bytes) -> None:
    _atomic(path, lambda f: f.write(data))


def dumps(obj, **kw) -> str:
    """Strict JSON (RFC 8259): NaN/Infinity become the strings "NaN"/"Infinity"/"-Infinity"
    (bare NaN tokens break jq, JavaScript and strict parsers); read_json turns them back."""
    return json.dumps(json_safe(obj), allow_nan=False, default=_json_default, **kw)


def write_json(path: str, obj) -> None:
    write_bytes(path, (dumps(obj, indent=2, sort_keys=False) + "\n").encode())


def write_jsonl(path: str, rows) -> None:
    write_bytes(path, "".join(dumps(r) + "\n" for r in rows).encode())


def write_safetensors(path: str, tensors: dict, metadata: dict | None = None) -> None:
    from safetensors.torch import save

    data = save(tensors, metadata=metadata)
    write_bytes(path, data)


def open_safetensors(path: str, device: str = "cpu"):
    """A lazy `.safetensors` reader (a context manager): keys, shapes via get_slice, and one
    tensor at a time, placed straight on `device` - never the whole file in host memory."""
    from safetensors import safe_open

    return safe_open(path, framework="pt", device=device)


# The most tpdiag reads of one file, by what it holds: read whole into memory (JSON is parsed into
# objects several times its size), a file past these is not one tpdiag wrote or a user meant - a
# 20 GB sparse events.jsonl must end in one line at once, not in a MemoryError minutes later.
# TPDIAG_MAX_READ_MB raises every cap (a capture of a very large model at op granularity).
MiB = 1 << 20
LIMIT_DOC = 256 * MiB      # one JSON document: manifest, summary, result, world.json, config.json
LIMIT_LINES = 2048 * MiB   # events.jsonl, diff.csv, a rollout file
LIMIT_SMALL = 16 * MiB     # a policy, a py: model file


def _limit(limit: int) -> int:
    return max(limit, max_read_mb() * MiB)


def max_read_mb() -> int:
    """TPDIAG_MAX_READ_MB (0: unset). A value that is no whole number is BadInput, one line: it was
    ignored, and a file past the cap the user meant to raise was refused as if it were unset."""
    mb = os.environ.get("TPDIAG_MAX_READ_MB", "").strip()
    if not mb:
        return 0
    if not (mb.isascii() and mb.isdigit()):
        from tpdiag.errors import BadInput

        raise BadInput(f"TPDIAG_MAX_READ_MB={mb!r}: expected a whole number of MiB (it raises every read "
                       "cap to that size)")
    return int(mb)


def _mb(n: int) -> str:
    return f"{n / MiB:.0f} MiB" if n >= MiB else f"{n} bytes"


def open_regular(path: str, encoding: str | None = "utf-8", newline: str | None = None,
                 limit: int = LIMIT_LINES, error=Inconclusive):
    """open() for reading that refuses anything but a regular file no larger than `limit` bytes
    (`error` is raised, naming the file and the limit): a FIFO would block the reader forever, a
    device (a link to /dev/zero) or a huge sparse file would fill memory. The open itself is
    non-blocking, so a FIFO with no writer is refused at once; a regular file ignores the flag."""
    import stat

    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = ("a FIFO" if stat.S_ISFIFO(st.st_mode) else "a device" if stat.S_ISCHR(st.st_mode)
                    or stat.S_ISBLK(st.st_mode) else "a socket" if stat.S_ISSOCK(st.st_mode) else
                    "a directory" if stat.S_ISDIR(st.st_mode) else "not a regular file")
            raise error(f"{path}: {kind}, not a regular file; refused")
        cap = _limit(limit)
        if st.st_size > cap:
            raise error(f"{path}: {_mb(st.st_size)}, over the {_mb(cap)} tpdiag reads from such a file "
                        "(TPDIAG_MAX_READ_MB raises it); refused")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "r" if encoding else "rb", encoding=encoding, newline=newline)
    except BaseException:
        os.close(fd)
        raise


def refuse_replacing(path: str, flag: str, mark: bytes, what: str) -> None:
    """An output file tpdiag would write over: replaced only where it is empty or tpdiag wrote it
    (`mark` in its first 4 KiB) - `report -o model.py` wrote the page over the user's model file and
    `gate --junit` over any file it named, exit 0. BadInput, one line, before anything is read."""
    from tpdiag.errors import BadInput

    if not os.path.lexists(path) or os.path.isdir(path):
        return  # none yet; a directory is the writer's own one-line refusal
    try:
        with open_regular(path, None, limit=LIMIT_LINES, error=BadInput) as f:
            head = f.read(4096)
    except BadInput as e:  # a FIFO, a device: never written over either
        raise BadInput(f"{flag} {str(e)}") from None
    except OSError:
        return  # unreadable: the write says why it cannot replace it
    if head and mark not in head:
        raise BadInput(f"{flag} {path!r}: exists and is not {what}; name a new file (or move that one away)")


def check_regular(path: str, limit: int, error) -> None:
    """open_regular's checks alone, for a file another library opens (a py: model file)."""
    open_regular(path, None, limit=limit, error=error).close()


def read_json(path: str):
    try:
        with open_regular(path, limit=LIMIT_DOC) as f:
            return json.load(f, object_hook=_restore)
    except FileNotFoundError:
        raise Inconclusive(f"{path}: missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError, MemoryError) as e:
        raise Inconclusive(f"{path}: corrupt JSON ({_brief(e)})") from None
    except OSError as e:  # a directory, no permission, an I/O error
        raise Inconclusive(f"{path}: unreadable ({e.strerror or e})") from None


def read_jsonl(path: str) -> list:
    try:
        with open_regular(path) as f:
            return [json.loads(line, object_hook=_restore) for line in f if line.strip()]
    except FileNotFoundError:
        raise Inconclusive(f"{path}: missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError, MemoryError) as e:
        raise Inconclusive(f"{path}: corrupt JSON lines ({_brief(e)})") from None
    except OSError as e:
        raise Inconclusive(f"{path}: unreadable ({e.strerror or e})") from None


def _brief(e: BaseException) -> str:
    # UnicodeDecodeError's message quotes the whole undecodable object: keep one short line.
    if isinstance(e, UnicodeDecodeError):
        return f"not UTF-8 at byte {e.start}"
    if isinstance(e, RecursionError):
        return "nested too deeply"
    if isinstance(e, MemoryError):
        return "too large to hold in memory"
    return str(e).splitlines()[0][:200] if str(e) else type(e).__name__


_NONFINITE = {"NaN": float("nan"), "Infinity": float("inf"), "-Infinity": float("-inf")}


def json_safe(o):
    """A copy of `o` (dicts, lists, scalars) with NaN/Infinity floats as strings: strict JSON."""
    if isinstance(o, float):
        if o != o:
            return "NaN"
        if o in (float("inf"), float("-inf")):
            return "Infinity" if o > 0 else "-Infinity"
        return o
    if isinstance(o, dict):
        return {k: json_safe(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [json_safe(v) for v in o]
    return o


def _restore_value(v):
    if isinstance(v, str):
        return _NONFINITE.get(v, v)
    if isinstance(v, list):
        return [_restore_value(x) for x in v]
    return v


def _restore(d: dict) -> dict:
    return {k: _restore_value(v) for k, v in d.items()}


def _json_default(o):
    if hasattr(o, "to_dict"):
        return json_safe(o.to_dict())
    if isinstance(o, (set, tuple)):
        return json_safe(list(o))
    return str(o)
