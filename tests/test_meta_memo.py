"""runner/meta_memo.py: DTensor's output-shape propagation remembered across worlds, in real 2-rank
gloo worlds. A world that reads what an earlier world (other placements) found computes the same
bits, global shapes and strides as a world that computes them itself; the memo's answers are the
ones DTensor uses (a poisoned memo changes the outcome); the key tells apart what changes the
answer (stride, dtype, a dim argument, a float's sign). The files are JSON read back exactly: a
pickle or a file off in any entry runs nothing and changes no answer."""
import os
import pickle

import torch
import torch.distributed as dist

from conftest import gloo_world


def _program(mesh, placements):
    from torch.distributed.tensor import distribute_tensor

    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(8, 6, generator=g), torch.randn(6, 4, generator=g)
    x, w = distribute_tensor(a, mesh, [placements[0]]), distribute_tensor(b, mesh, [placements[1]])
    y = x @ w
    z = torch.softmax(y, -1).sum(0) + y.t().contiguous().sum(1) * 2.0
    t = y.t()  # a strided view: its stride is part of what is propagated
    outs = [y, z, t, (t * -0.0).sum(0), y.to(torch.float64).mean(1)]
    # bytes, not tensors: a tensor on the queue is shared through an fd the exiting rank closes
    return [(tuple(o.shape), tuple(o.stride()), str(o.dtype), o.full_tensor().contiguous().numpy().tobytes())
            for o in outs]


def _worker(rank, world, port, q):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    from tpdiag.runner import meta_memo

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    path, mode = os.environ["MEMO_DIR"], os.environ["MEMO_MODE"]
    if mode == "poisoned":
        table = {}
        for name in os.listdir(path):
            with open(os.path.join(path, name), "rb") as f:
                table.update(meta_memo._parse(f.read(), torch.__version__))
        for k, v in table.items():  # every remembered output one row longer
            if isinstance(v, TensorMeta):
                table[k] = TensorMeta(torch.Size((v.shape[0] + 1, *v.shape[1:])), v.stride, v.dtype)
        if rank == 0:
            with open(os.path.join(path, "poison.json"), "w") as f:
                f.write(meta_memo._dump(table, torch.__version__))
        dist.barrier()
    out = {}
    if mode == "first":  # the reference: the second program, computed here with no memo at all
        out["fresh"] = _program(mesh, (Replicate(), Shard(1)))
        spec = lambda shape, stride, dtype: DTensorSpec(mesh, (Replicate(),), TensorMeta(torch.Size(shape), stride, dtype))  # noqa: E731
        base = meta_memo._spell((spec((8, 6), (6, 1), torch.float32), 0), DTensorSpec)
        out["keys_differ"] = [base != meta_memo._spell(other, DTensorSpec) for other in (
            (spec((8, 6), (1, 8), torch.float32), 0), (spec((8, 6), (6, 1), torch.float64), 0),
            (spec((8, 6), (6, 1), torch.float32), 1), (spec((8, 6), (6, 1), torch.float32), True))]
        out["keys_differ"].append(meta_memo._spell((0.0,), DTensorSpec) != meta_memo._spell((-0.0,), DTensorSpec))
    memo = meta_memo.Memo(path)
    memo.install()
    # the first world's program has other placements: what the later world reads is the memo's
    placements = (Shard(0), Replicate()) if mode == "first" else (Replicate(), Shard(1))
    try:
        out["result"] = _program(mesh, placements)
    except Exception as e:  # noqa: BLE001 - the poisoned memo's outcome
        out["error"] = type(e).__name__
    out.update(loaded=len(memo.table) - len(memo.new), hits=memo.hits, new=len(memo.new))
    if mode == "first":
        memo.save()
        dist.barrier()
    if rank == 0:
        q.put(out)
    dist.barrier()


def test_a_later_world_reads_the_memo_and_computes_the_same(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMO_DIR", str(tmp_path))
    monkeypatch.setenv("MEMO_MODE", "first")
    first = gloo_world(_worker, 2)
    assert first["new"] > 0 and first["loaded"] == 0
    assert len(os.listdir(tmp_path)) == 2  # one file a rank, written whole (no .part left)
    assert all(first["keys_differ"]), first["keys_differ"]
    monkeypatch.setenv("MEMO_MODE", "read")
    read = gloo_world(_worker, 2)
    assert read["loaded"] == first["new"] and read["hits"] > 0
    fresh = first["fresh"]
    assert len(read["result"]) == len(fresh)
    for (shape, stride, dtype, full), (shape0, stride0, dtype0, full0) in zip(read["result"], fresh):
        assert (shape, stride, dtype) == (shape0, stride0, dtype0)
        assert full == full0  # bitwise
    # negative control: the memo's answers are what DTensor uses - one wrong shape, another outcome
    monkeypatch.setenv("MEMO_MODE", "poisoned")
    poisoned = gloo_world(_worker, 2)
    assert poisoned["hits"] > 0
    assert "error" in poisoned or [r[0] for r in poisoned["result"]] != [r[0] for r in fresh]


def test_a_folder_others_can_write_is_not_read(tmp_path, monkeypatch):
    from tpdiag.runner import meta_memo

    monkeypatch.setattr(meta_memo.tempfile, "gettempdir", lambda: str(tmp_path))
    monkeypatch.delenv("TPDIAG_META_MEMO", raising=False)  # the session's shared one (conftest)
    pid = os.getpid()
    path = meta_memo._folder(pid, meta_memo._born(pid))
    os.mkdir(path, 0o755)
    os.chmod(path, 0o777)
    assert meta_memo.rank_memo(pid) is None
    os.rmdir(path)
    assert meta_memo.rank_memo(pid) is None  # no folder: computed as before


def test_off_switch(tmp_path, monkeypatch):
    from tpdiag.runner import meta_memo

    monkeypatch.setattr(meta_memo.tempfile, "gettempdir", lambda: str(tmp_path))
    monkeypatch.setenv("TPDIAG_META_MEMO", "0")
    monkeypatch.setattr(meta_memo, "_OWNER", {})
    meta_memo.launcher_folder()
    assert os.listdir(tmp_path) == []
    monkeypatch.delenv("TPDIAG_META_MEMO")
    meta_memo.launcher_folder()
    (made,) = os.listdir(tmp_path)
    assert os.stat(tmp_path / made).st_mode & 0o777 == 0o700


def _meta(shape, stride, dtype=torch.float32):
    from torch.distributed.tensor._dtensor_spec import TensorMeta

    return TensorMeta(torch.Size(shape), stride, dtype)


def _write(path, table, version=None):
    from tpdiag.runner import meta_memo

    with open(path, "w") as f:
        f.write(meta_memo._dump(table, version or torch.__version__))


def test_a_shared_folder_merges_and_skips_another_torch(tmp_path, monkeypatch):
    from tpdiag.runner import meta_memo

    for i in range(meta_memo.MERGE_AT):
        _write(tmp_path / f"{i}.json", {("op", i): _meta((i,), (1,))})
    _write(tmp_path / "other.json", {("op", -1): None}, "0.0")  # another torch's answers are never read
    memo = meta_memo.Memo(str(tmp_path))
    assert memo.table == {}  # read at the first DTensor op, not before
    memo.load()
    assert memo.table == {("op", i): _meta((i,), (1,)) for i in range(meta_memo.MERGE_AT)}
    memo.new[("op", "new")] = memo.table[("op", "new")] = None
    memo.save()
    (merged,) = (n for n in os.listdir(tmp_path) if n != "other.json")
    assert merged.endswith(".json")
    again = meta_memo.Memo(str(tmp_path))
    again.load()
    assert again.table == memo.table
    # the launcher makes a shared folder it names, and leaves it at its exit
    shared = tmp_path / "shared"
    monkeypatch.setenv("TPDIAG_META_MEMO", str(shared))
    monkeypatch.setattr(meta_memo, "_OWNER", {})
    meta_memo.launcher_folder()
    assert shared.is_dir() and os.stat(shared).st_mode & 0o777 == 0o700


def test_the_json_reads_back_exactly():
    from tpdiag.runner import meta_memo

    key = ("aten.mm.default", ("tuple", (("T", (8, 6), (6, 1), "torch.float32", "cpu"), ("NoneType", None),
                                         ("bool", True), ("int", -1), ("float", "-0.0"))), (("dim", ("int", 0)),))
    table = {key: _meta((8, 4), (4, 1)), ("b",): (_meta((2, 0), (1, 1), torch.bfloat16), None),
             ("c",): [_meta((), ())], ("d",): None, ("e",): []}
    back = meta_memo._parse(meta_memo._dump(table, torch.__version__).encode(), torch.__version__)
    assert back == table
    assert [type(v) for v in back.values()] == [type(v) for v in table.values()]  # tuple stays tuple, list list
    assert type(back[key].shape) is torch.Size and type(back[key].stride) is tuple
    assert back[("b",)][0].dtype is torch.bfloat16
    first = next(iter(back))  # the key as parsed: tuples all the way down, -0.0 still its own
    assert first == key and type(first[1][1]) is tuple and first[1][1][4] == ("float", "-0.0")


class _Payload:
    """Unpickling this creates a file: evidence that something unpickled it."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_crafted_file_runs_nothing_and_changes_no_answer(tmp_path):
    """A file in the memo's folder that is not wholly what _dump writes is a miss: a pickle (under
    the old name or the new) runs nothing, and a file off in one entry gives none of its entries -
    here each one's other entry would turn the genuine answer into another shape. On the pickle
    memo before, the .pkl payload ran (MARKER made)."""
    import json

    from tpdiag.runner import meta_memo

    marker = tmp_path / "MARKER"
    memo_dir = tmp_path / "memo"
    memo_dir.mkdir()
    key, good = ("aten.mm.default", ("int", 1)), _meta((8, 4), (4, 1))
    _write(memo_dir / "0-genuine.json", {key: good})
    payload = pickle.dumps({"torch": torch.__version__, "table": {key: _Payload(str(marker))}})
    (memo_dir / "z-payload.pkl").write_bytes(payload)
    (memo_dir / "z-payload.json").write_bytes(payload)
    row = [json.loads(json.dumps(key)), None]
    wrong = {"shape": [9, 4], "stride": [4, 1], "dtype": "torch.float32"}  # would change the answer
    off_entries = {
        "dtype": {"shape": [1], "stride": [1], "dtype": "os.system"},
        "dtype-attr": {"shape": [1], "stride": [1], "dtype": "torch.float32.__class__"},
        "float-dim": {"shape": [1.0], "stride": [1], "dtype": "torch.float32"},
        "bool-dim": {"shape": [True], "stride": [1], "dtype": "torch.float32"},
        "negative": {"shape": [-1], "stride": [1], "dtype": "torch.float32"},
        "huge": {"shape": [1 << 63], "stride": [1], "dtype": "torch.float32"},
        "huge-stride": {"shape": [1], "stride": [-(1 << 63) - 1], "dtype": "torch.float32"},
        "ranks": {"shape": [1, 1], "stride": [1], "dtype": "torch.float32"},
        "extra": {**wrong, "code": "x"},
        "seq": {"tuple": "abc"},
        "kind": {"set": []},
        "number": 3,
    }
    for name, entry in off_entries.items():
        doc = {"torch": torch.__version__, "table": [[row[0], wrong], [["other"], entry]]}
        (memo_dir / f"z-{name}.json").write_text(json.dumps(doc))
    for name, k in {"key-dict": [{"a": 1}], "key-float": [1.5], "key-flat": "op"}.items():
        doc = {"torch": torch.__version__, "table": [[row[0], wrong], [k, None]]}
        (memo_dir / f"z-{name}.json").write_text(json.dumps(doc))
    whole = json.dumps({"torch": torch.__version__, "table": [[row[0], wrong]]})
    (memo_dir / "z-cut.json").write_text(whole[:-3])
    (memo_dir / "z-nan.json").write_text(whole.replace("[[[", "[[[NaN,", 1))
    (memo_dir / "z-deep.json").write_text("[" * 200_000)
    (memo_dir / "z-bytes.json").write_bytes(b"\xff\xfe\x00garbage")
    (memo_dir / "z-list.json").write_text("[]")
    memo = meta_memo.Memo(str(memo_dir))
    memo.load()
    assert not marker.exists()
    assert memo.read == ["0-genuine.json"]
    assert memo.table == {key: good} and memo.table[key].shape == (8, 4)
    # control: the same wrong answer in a file wholly as _dump writes it is read (its folder's
    # owner is trusted, rank_memo) - the crafted ones above were refused for their off entries
    (memo_dir / "z-whole.json").write_text(whole)
    again = meta_memo.Memo(str(memo_dir))
    again.load()
    assert again.read == ["0-genuine.json", "z-whole.json"] and again.table[key].shape == (9, 4)


def test_a_rank_reads_its_own_models_group_only(tmp_path, monkeypatch):
    """One shared folder for many models (a test session's): each rank reads the subfolder of its
    run's model and shapes (meta_memo.group_of), not every model's entries; the subfolder is made
    0700, and one others can write is not read."""
    from types import SimpleNamespace

    from tpdiag.runner import meta_memo

    shared = tmp_path / "shared"
    shared.mkdir(mode=0o700)
    monkeypatch.setenv("TPDIAG_META_MEMO", str(shared))
    llama = SimpleNamespace(model="tiny-llama", dtype="float32", batch_size=2, seq_len=16, variant="stock", layers=0)
    groups = {meta_memo.group_of(llama), meta_memo.group_of(SimpleNamespace(**{**vars(llama), "model": "py:x.py:f"})),
              meta_memo.group_of(SimpleNamespace(**{**vars(llama), "seq_len": 32})),
              meta_memo.group_of(SimpleNamespace(**{**vars(llama), "dtype": "bfloat16"}))}
    assert len(groups) == 4
    g = meta_memo.group_of(llama)
    monkeypatch.setattr(meta_memo.Memo, "install", lambda self: None)  # not on this process's DTensor
    _write(shared / "other-model.json", {("op", 1): _meta((9,), (1,))})  # the folder itself: not read
    memo = meta_memo.rank_memo(os.getpid(), g)
    assert memo is not None and memo.path == str(shared / g)
    assert os.stat(shared / g).st_mode & 0o777 == 0o700
    _write(shared / g / "mine.json", {("op", 1): _meta((8,), (1,))})
    memo.load()
    assert memo.table == {("op", 1): _meta((8,), (1,))} and memo.read == ["mine.json"]
    os.chmod(shared / g, 0o777)
    assert meta_memo.rank_memo(os.getpid(), g) is None
