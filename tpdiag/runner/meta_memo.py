"""DTensor's output-shape propagation, remembered across the worlds one launcher starts.

Before DTensor runs an op for the first time with given input specs, it runs the op once more on
fake tensors of the inputs' global shapes to learn the output's global shape, stride and dtype
(ShardingPropagator._propagate_tensor_meta_non_cached). Its caches live in the process, so every
rank of every world paid it again: about half of a tiny model's TP=2 rank on a CPU. The answer
is a function of the op, the inputs' global (shape, stride, dtype, device type) and the non-tensor
arguments alone - not of the placements, the degree or the rank - so one launcher's worlds share
it: each rank reads what earlier ranks found from a folder its launcher made, and adds what it
found itself before its completion marker. An argument of any other kind (a plain tensor, a
symbolic size, an object this key does not spell) is never remembered: computed as before.
Nothing numeric changes: the ranks compute the same values from the same specs.
The files are JSON, parsed back exactly and checked whole: a file another process or user could
write is then data, never code (pickle would run what it names), and one that is cut short,
foreign or off in any entry is a miss - every answer it holds is computed again.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile

_OWNER: dict = {}  # launcher side: this process's pid -> its folder


def _folder(launcher_pid: int, born: str) -> str:
    return os.path.join(tempfile.gettempdir(), f"tpdiag-dtmeta-{launcher_pid}-{born}")


def _born(pid: int) -> str | None:
    """The process's start time (/proc; None without it: no memo)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[19]
    except (OSError, IndexError):
        return None


def _shared() -> str | None:
    """TPDIAG_META_MEMO=/abs/folder: one memo for every launcher that names it (a test session's,
    a user's many compares), made if missing, never removed; its entries carry torch's version."""
    v = os.environ.get("TPDIAG_META_MEMO", "1")
    return v if os.path.isabs(v) else None


def launcher_folder() -> None:
    """Launcher side, before a world starts: this process's folder, made once (mode 0700) and
    removed at its exit. A process forked from a launcher (the tests' CLI server) makes its own."""
    pid = os.getpid()
    if pid in _OWNER or os.environ.get("TPDIAG_META_MEMO", "1") == "0":
        return
    shared = _shared()
    born = _born(pid)
    if born is None and shared is None:
        return
    path = shared or _folder(pid, born)
    try:
        os.makedirs(path, 0o700, exist_ok=True)
    except OSError:
        return  # no memo: the ranks compute as before
    _OWNER[pid] = path
    if shared is None:
        import atexit

        atexit.register(_remove, pid, path)


def _remove(pid: int, path: str) -> None:
    if os.getpid() == pid:  # not in a forked child that inherited the registration
        shutil.rmtree(path, ignore_errors=True)


class _Skip(Exception):
    pass


def _spell(x, spec_type):
    if isinstance(x, spec_type):
        m = x.tensor_meta
        if m is None or not all(type(n) is int for n in (*m.shape, *m.stride)):
            raise _Skip
        return ("T", tuple(m.shape), tuple(m.stride), str(m.dtype), str(x.mesh.device_type))
    if x is None or type(x) in (bool, int, str):
        return (type(x).__name__, x)
    if type(x) is float:
        return ("float", repr(x))  # -0.0 and 0.0 are equal keys otherwise
    import torch

    if isinstance(x, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return (type(x).__name__, str(x))
    if type(x) in (list, tuple):
        return (type(x).__name__, tuple(_spell(i, spec_type) for i in x))
    raise _Skip


SUFFIX = ".json"


def _meta_json(v):
    """One answer of _propagate_tensor_meta_non_cached - a TensorMeta, a tuple or list of them
    (None for an output that is no tensor), or None - as JSON; _Skip for a symbolic size."""
    import torch
    from torch.distributed.tensor._dtensor_spec import TensorMeta

    if v is None:
        return None
    if type(v) is TensorMeta:
        if not (all(type(n) is int for n in (*v.shape, *v.stride)) and isinstance(v.dtype, torch.dtype)):
            raise _Skip
        return {"shape": list(v.shape), "stride": list(v.stride), "dtype": str(v.dtype)}
    if type(v) in (tuple, list):
        return {type(v).__name__: [_meta_json(i) for i in v]}
    raise _Skip


def _ints(x, least: int = -1 << 63) -> bool:
    # sizes and strides are int64 in torch: a larger one makes a torch.Size nothing can use
    return type(x) is list and all(type(n) is int and least <= n < 1 << 63 for n in x)


def _meta(j, dtypes: dict):
    """_meta_json's inverse, exact (torch.Size, tuple stride, the dtype itself); ValueError for
    anything it does not write."""
    from torch import Size
    from torch.distributed.tensor._dtensor_spec import TensorMeta

    if j is None:
        return None
    if type(j) is not dict:
        raise ValueError(j)
    if j.keys() == {"shape", "stride", "dtype"}:
        shape, stride, dtype = j["shape"], j["stride"], j["dtype"]
        if not (_ints(shape, 0) and _ints(stride) and len(shape) == len(stride)
                and type(dtype) is str and dtype in dtypes):
            raise ValueError(j)
        return TensorMeta(Size(shape), tuple(stride), dtypes[dtype])
    if len(j) != 1:
        raise ValueError(j)
    ((kind, items),) = j.items()
    if kind not in ("tuple", "list") or type(items) is not list:
        raise ValueError(j)
    seq = [_meta(i, dtypes) for i in items]
    return tuple(seq) if kind == "tuple" else seq


def _key(j):
    """JSON's arrays back to the tuples _spell builds; a leaf _spell never writes: foreign."""
    if type(j) is list:
        return tuple(_key(i) for i in j)
    if j is None or type(j) in (str, int, bool):
        return j
    raise ValueError(j)


def _foreign(text):
    raise ValueError(text)  # a float, NaN or Infinity: _spell writes floats as their repr


def _dump(table: dict, version: str) -> str:
    return json.dumps({"torch": version, "table": [[k, _meta_json(v)] for k, v in table.items()]},
                      allow_nan=False, separators=(",", ":"))


def _parse(data: bytes, version: str) -> dict | None:
    """A memo file's table; None for another torch's; ValueError for one not wholly as _dump
    writes it (no entry of it is used)."""
    import torch

    doc = json.loads(data, parse_float=_foreign, parse_constant=_foreign)
    if type(doc) is not dict:
        raise ValueError("not an object")
    if doc.get("torch") != version:
        return None
    rows = doc.get("table")
    if type(rows) is not list:
        raise ValueError("no table")
    dtypes = {str(d): d for d in vars(torch).values() if isinstance(d, torch.dtype)}
    table = {}
    for row in rows:
        if type(row) is not list or len(row) != 2 or type(row[0]) is not list:
            raise ValueError(row)
        table[_key(row[0])] = _meta(row[1], dtypes)
    return table


class Memo:
    """Rank side: installed on DTensor's propagator; save() writes what this rank added."""

    def __init__(self, path: str):
        import torch

        self.path, self.table, self.new, self.hits, self.read = path, {}, {}, 0, []
        self.version, self.loaded = torch.__version__, False

    def load(self) -> None:
        """The folder's answers, read at the rank's first DTensor op (a TP=1 world or a model
        sharded by hand reads nothing)."""
        self.loaded = True
        for name in sorted(os.listdir(self.path)):
            if not name.endswith(SUFFIX):
                continue
            try:
                with open(os.path.join(self.path, name), "rb") as f:
                    table = _parse(f.read(), self.version)
            except Exception:  # noqa: BLE001 - gone (merged by another rank), cut short, foreign: computed again
                continue
            if table is not None:
                self.table.update(table)
                self.read.append(name)

    def install(self) -> None:
        from torch.distributed.tensor import DTensor, _sharding_prop
        from torch.distributed.tensor._dtensor_spec import DTensorSpec

        prop = DTensor._op_dispatcher.sharding_propagator
        compute = prop._propagate_tensor_meta_non_cached
        tracing = _sharding_prop._are_we_tracing

        def remembered(op_schema):
            if tracing():
                return compute(op_schema)
            try:
                key = (str(op_schema.op), _spell(tuple(op_schema.args_schema), DTensorSpec),
                       tuple(sorted((k, _spell(v, DTensorSpec)) for k, v in op_schema.kwargs_schema.items())))
            except _Skip:
                return compute(op_schema)
            if not self.loaded:
                try:
                    self.load()
                except OSError:  # the folder gone: computed as before
                    pass
            if key in self.table:
                self.hits += 1
                return self.table[key]
            out = compute(op_schema)
            try:
                _meta_json(out)
            except _Skip:  # a shape JSON does not spell (symbolic): not remembered
                return out
            self.table[key] = self.new[key] = out
            return out

        prop._propagate_tensor_meta_non_cached = remembered

    def save(self) -> None:
        """What this rank added, in a file of its own (written whole, then renamed). Past MERGE_AT
        files it writes the whole table and removes the files it read, so a long-lived shared
        folder stays a few files: a rank that listed one of those meanwhile computes it again."""
        if not self.new:
            return
        merge = len(self.read) >= MERGE_AT
        part = None
        try:
            fd, part = tempfile.mkstemp(dir=self.path, prefix=f"{os.getpid()}-", suffix=".part")
            with os.fdopen(fd, "w") as f:
                f.write(_dump(self.table if merge else self.new, self.version))
            os.replace(part, part[:-len(".part")] + SUFFIX)
            part = None
            for name in self.read if merge else ():
                try:
                    os.unlink(os.path.join(self.path, name))
                except OSError:
                    pass
        except Exception:  # noqa: BLE001 - a memo never fails a rank
            if part is not None:
                try:
                    os.unlink(part)
                except OSError:
                    pass


MERGE_AT = 32


def group_of(settings) -> str:
    """A run's memo subfolder: its model and the settings that set its shapes. A rank reads every
    file of its folder at its first DTensor op; one folder for a whole test session (or a user's
    many compares) grew with every model run there (~5000 entries: ~0.4 s of CPU a rank to read,
    more than the memo saves). The keys stay whole: a group is where to look, never an answer."""
    import hashlib

    parts = tuple(str(getattr(settings, k, "")) for k in ("model", "dtype", "batch_size", "seq_len", "variant", "layers"))
    return "m-" + hashlib.sha256(repr(parts).encode()).hexdigest()[:16]


def _own(path: str) -> bool:
    st = os.stat(path)
    return st.st_uid == os.getuid() and not st.st_mode & 0o077


def rank_memo(launcher_pid: int | None, group: str | None = None) -> Memo | None:
    """Rank side: the launcher's memo (or the shared one) installed in this rank, or None (no
    folder, or one others can write: computed as before). group (group_of): the subfolder this
    rank reads and writes, made (mode 0700) if missing."""
    if not launcher_pid or os.environ.get("TPDIAG_META_MEMO", "1") == "0":
        return None
    path = _shared()
    if path is None:
        born = _born(launcher_pid)
        if born is None:
            return None
        path = _folder(launcher_pid, born)
    try:
        if not _own(path):
            return None  # not this user's own folder: nothing is read from it
        if group is not None:
            path = os.path.join(path, group)
            os.makedirs(path, 0o700, exist_ok=True)
            if not _own(path):
                return None
    except OSError:
        return None
    try:
        memo = Memo(path)
        memo.install()
    except Exception:  # noqa: BLE001 - another torch's propagator, an unreadable folder: as before
        return None
    return memo
