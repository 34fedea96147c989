"""The host-time shortcuts of hash-mode recording (`git show d055ef2:docs/benchmarks.md`, "Host work
per record, session 8"):
a plain tensor's compact row becomes the meta the general path builds, keys in the same order;
a module called several times in a step gets its calls counted from hooks set up once; nothing
recorded is kept alive past the queue; a kept-whole record hashed later, and a small record off
the Triton path hashed at take(), give the hashes of the values recorded, not of later ones; the
queue's cached launch row is batch_entry's. In-process, no gloo world, no Triton launch."""
import gc
import weakref

import pytest
import torch
from torch import nn

from tpdiag.kernels import hash_buffer as hb
from tpdiag.kernels import record_hash as rh
from tpdiag.kernels import record_hash_batch as rb
from tpdiag.probes.module_probe import module_probes
from tpdiag.probes.recorder import Recorder, take_lanes


class _Sub(torch.Tensor):
    """A plain tensor subclass: Recorder.add's general path, the same layout as a plain tensor."""


def _lanes(rec):
    rows = [s for s in rec.lanes if s is not None]
    ints, floats = take_lanes(rec.hashbuf, rows)
    by = dict(zip(rows, zip(ints, floats)))
    return [by.get(s) for s in rec.lanes]


def test_compact_rows_equal_the_general_paths_metas():
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(3, 5, generator=g), torch.randn(7, generator=g).to(torch.bfloat16),
          torch.randint(0, 9, (2, 4), generator=g)]
    recs = []
    for sub in (False, True):
        rec = Recorder(mode="hash")
        rec.phase = "forward"
        for i, x in enumerate(xs):
            t = x.as_subclass(_Sub) if sub else x
            assert (type(t) is torch.Tensor) != sub
            m = rec.add("out", f"layers.{i}", "0", t, call=i, style="colwise", cls="Linear",
                        layout="partial" if i == 1 else None)
            assert m is not None
        rec.add("in", "layers.9", "0", xs[0] if not sub else xs[0].as_subclass(_Sub))
        recs.append(rec)
    fast, general = recs
    assert fast._rows and all(type(r) is list for r in fast._rows)  # the fast path ran
    assert all(type(r) is tuple for r in general._rows)               # the general path ran
    mf, mg = [m for m, _ in fast.records], [m for m, _ in general.records]
    assert [list(m.items()) for m in mf] == [list(m.items()) for m in mg]  # keys, order, values
    assert [m["idx"] for m in mf] == list(range(4))
    assert mf[3]["key"] == "s0/forward/layers.9/in#0/0"
    lf, lg = _lanes(fast), _lanes(general)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(lf, lg))
    # the negative control: a different value hashes differently
    assert not torch.equal(lf[0][0], lf[1][0])


def test_extras_of_a_pending_row_reach_its_meta_before_and_after_it_is_made():
    rec = Recorder(mode="hash")
    rec.phase = "forward"
    a, b = torch.randn(4), torch.randn(4)
    from tpdiag.probes.rows import consumers_of, extras

    ra = rec.add("out", "a", "0", a)
    extras(ra).setdefault("consumers", []).append("x")
    assert consumers_of(ra) == ["x"]
    rb = rec.add("out", "b", "0", b)
    assert consumers_of(rb) == ()
    metas = [m for m, _ in rec.records]        # rows made metas now
    extras(rb)["consumers"] = ["y"]            # a key added after: it goes to the meta itself
    assert metas[0]["consumers"] == ["x"] and metas[1]["consumers"] == ["y"]
    assert list(metas[0])[-1] == "consumers"


class _Reuse(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(self.lin(self.lin(x)))  # one module, three calls


def test_a_module_called_three_times_records_three_calls_and_its_grads():
    torch.manual_seed(0)
    m, rec = _Reuse(), Recorder(mode="hash")
    with module_probes(m, rec):
        rec.phase = "forward"
        y = m(torch.randn(2, 4))
        rec.phase = "backward"
        y.sum().backward()
    keys = [r["key"] for r, _ in rec.records]
    for c in range(3):
        assert f"s0/forward/lin/out#{c}/0" in keys and f"s0/forward/lin/in#{c}/0" in keys
        assert f"s0/backward/lin/grad_out#{c}/0" in keys
    assert keys.count("s0/backward/lin/param_grad#0/weight") == 1
    assert not m.lin._forward_hooks and not m.lin._forward_pre_hooks  # removed on exit
    assert not m.lin.weight._post_accumulate_grad_hooks


@pytest.mark.parametrize("queued", [True, False])
def test_recorded_tensors_are_not_kept_alive_past_the_queue(monkeypatch, queued):
    if queued:  # as on CUDA: the records wait in the queue for one launch
        monkeypatch.setattr(rh, "triton_ok", lambda t: type(t) is torch.Tensor and t.dtype in rh._TRITON_T)
        monkeypatch.setattr(rb, "batch_launch", lambda *a, **k: None)
    rec = Recorder(mode="hash")
    rec.phase = "forward"
    x = torch.randn(8, 8, requires_grad=True)
    h = x * 2
    y = h.sin()                   # its autograd node saves h
    p = nn.Parameter(torch.randn(8))
    ry, rp, rh_ = weakref.ref(y), weakref.ref(p), weakref.ref(h)
    rec.add("out", "m", "0", y)
    rec.add("param", "m", "w", p)
    # queued: held until the launch, as the owner always was; else copies, hashed at take()
    assert rec.hashbuf.queued == (2 if queued else 0)
    assert len(rec.hashbuf.deferred) == (0 if queued else 2)
    rec.phase = "loss"               # a phase change flushes the queue
    del y, p, h
    gc.collect()
    assert ry() is None and rp() is None and rh_() is None  # nor the graph behind y
    assert len(rec.records) == 2


def test_deferred_hashes_are_of_the_values_recorded():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 100, (2, 8), generator=g)
    loss = torch.tensor(2.5)
    want_ids = rh.shard_lanes(ids.clone())[0].clone()
    from tpdiag.records.hashing import tensor_hash

    want_loss = tensor_hash(loss.clone())
    rec = Recorder(mode="hash")
    rec.phase = "forward"
    rec.add("in", "tok", "0", ids)          # int64: off the Triton path, hashed at take()
    rec.add("loss", "model", "loss", loss)  # kept whole, hashed when records are read
    assert rec.hashbuf.deferred and rec._unhashed
    ids.add_(1)
    loss.mul_(3)                            # changed after the record
    metas = [m for m, _ in rec.records]
    assert metas[1]["hash"] == want_loss != tensor_hash(loss)
    got = rec.hashbuf.take([rec.lanes[0]])[0][0].clone()
    got[:2] &= rh.M32
    want_ids[:2] &= rh.M32
    now = rh.shard_lanes(ids)[0].clone()
    now[:2] &= rh.M32
    assert torch.equal(got, want_ids) and not torch.equal(got, now)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cached_launch_rows_are_batch_entrys(monkeypatch, dtype):
    launched = []
    monkeypatch.setattr(rh, "triton_ok", lambda t: type(t) is torch.Tensor and t.dtype in rh._TRITON_T)
    monkeypatch.setattr(rb, "batch_launch", lambda key, table, n, *a, **k: launched.append(
        (key, table.view(n, rb.TABLE_COLS).tolist())))
    hb._ENTRIES.clear()
    base = torch.randn(4096 + 8).to(dtype)
    cases = []
    for shape in ((16, 64), (3, 10, 33), (130,)):
        n = 1
        for s in shape:
            n *= s
        for off in (0, 1, 8):  # data pointers at different alignments
            cases.append((base[off:off + n].view(shape), None, None, 0))
        cases.append((base[:n].view(shape), 0, shape[0] * 2, shape[0]))  # a shard's place
    buf = hb.HashBuffer(torch.device("cpu"), batch=4)
    want = []
    for k in range(2):  # the second pass reads the cache
        for t, d, f, o in cases:
            slot = buf.add(t, d, f, o)
            key, _, row = rb.batch_entry(t, d, f, o, slot % buf.CHUNK)
            want.append((key, list(row)))
    buf.flush()
    got = [(key, row) for key, rows in launched for row in rows]
    assert sorted(map(repr, got)) == sorted(map(repr, want)) and len(got) == 2 * len(cases)



def _capture_launches(monkeypatch, ptrs: dict, got: list) -> None:
    """batch_launch records (launch key, its table rows) into got, each row's data pointer as
    the index of its tensor in ptrs ("copy" for a queued copy)."""
    def rows(table, n):
        return [[ptrs.get(r[0], "copy")] + r[1:] for r in table.view(-1, rb.TABLE_COLS)[:n].tolist()]

    monkeypatch.setattr(rb, "batch_launch", lambda key, table, n, *a, **k: got.append((key, rows(table, n))))


def test_add_whole_queues_what_add_queues(monkeypatch):
    """HashBuffer.add_whole (Recorder.add's fast path) against add: the same slots, launch keys
    and table rows, for contiguous tensors at several alignments, a Parameter, a strided view
    and an int64 tensor (the last two not its inline case), over more than one chunk."""
    launched = {}
    monkeypatch.setattr(rh, "triton_ok", lambda t: type(t) is torch.Tensor and t.dtype in rh._TRITON_T
                        and t.numel() > 0)
    monkeypatch.setattr(hb.HashBuffer, "CHUNK", 8)
    hb._ENTRIES.clear()
    base = torch.randn(4096 + 8)
    ts = [base[off:off + 6 * 7].view(6, 7) for off in (0, 1, 4)]
    ts += [nn.Parameter(torch.randn(5, 3)), base[:64].view(8, 8).t(), torch.arange(6),
           base[:8].to(torch.bfloat16), torch.empty(0)]
    ptrs = {t.data_ptr(): i for i, t in enumerate(ts)}  # a strided view is queued as a copy
    for way in ("add", "add_whole"):
        got = launched[way] = []
        _capture_launches(monkeypatch, ptrs, got)
        buf = hb.HashBuffer(torch.device("cpu"), batch=5)
        slots = []
        for _ in range(3):
            for t in ts:
                slots.append(buf.add(t if type(t) is torch.Tensor else t.detach()) if way == "add"
                             else buf.add_whole(t, t.shape, t.dtype, t._version))
        buf.flush()
        got.append(slots)
    assert launched["add"] == launched["add_whole"]
    assert len(launched["add"]) > 3  # launches ran, more than one chunk's
    assert launched["add"][-1] == list(range(3 * len(ts)))


def test_add_span_queues_what_add_queues(monkeypatch):
    """HashBuffer.add_span (a decode call's record: the same geometry one position further on)
    against add: the same slots, launch keys and table rows - the offset's column included - at
    several offsets, alignments and dims, over more than one chunk; a strided view is add's."""
    launched = {}
    monkeypatch.setattr(rh, "triton_ok", lambda t: type(t) is torch.Tensor and t.dtype in rh._TRITON_T
                        and t.numel() > 0)
    monkeypatch.setattr(hb.HashBuffer, "CHUNK", 8)
    hb._ENTRIES.clear()
    hb._SPANS.clear()
    base = torch.randn(4096 + 8)
    # (tensor, dim, whole size of dim): [B, 1, D] at dim 1 of [B, L, D]; [1, D] at dim 0 of [L, D]
    cases = [(base[off:off + 2 * 5].view(2, 1, 5), 1, 9) for off in (0, 1, 4)]
    cases += [(base[:6].view(1, 6), 0, 9), (base[:6].to(torch.bfloat16).view(1, 6), 0, 9),
              (base[:20].view(5, 4).t()[:1], 0, 9)]
    ptrs = {t.data_ptr(): i for i, (t, _, _) in enumerate(cases)}
    for way in ("add", "add_span"):
        got = launched[way] = []
        _capture_launches(monkeypatch, ptrs, got)
        buf = hb.HashBuffer(torch.device("cpu"), batch=5)
        slots = []
        for offset in (0, 3, 8):
            for t, d, full in cases:
                slots.append(buf.add(t, d, full, offset) if way == "add"
                             else buf.add_span(t, d, full, offset, t._version))
        buf.flush()
        got.append(slots)
    assert launched["add"] == launched["add_span"]
    assert len(launched["add"]) > 3
    # a CPU tensor never takes a row cached for a CUDA tensor of its geometry (its pointer is no
    # device address): the cache is keyed by the device kind, and a miss asks triton_ok
    assert all(k[-1] is False for k in hb._SPANS)
    # the offset's column (O_B) differs between the offsets: not one row reused for all
    assert len({tuple(r[1:]) for _, rs in launched["add_span"][:-1] for r in rs}) > len(cases)


@pytest.mark.parametrize("world", [1, 2])
def test_decode_span_rows_are_the_general_paths_records(monkeypatch, world):
    """A decode world's records through the span path (spans.add_span: one planned row per key,
    its calls' slots in a list) and through hash_piece for every call: the same merged metas (keys
    in the same order) and the same lanes, at batch 1 and 2 (folded rows), at TP=1 and as rank 1 of
    TP=2 (plain local shards: columns, heads - a piece that is also a shard, one row per sequence),
    with a cache that grows (left out alike) and keys placed only from a later call on."""
    from tpdiag.probes import piece_merge, spans
    from tpdiag.probes.recorder import Recorder, take_lanes
    from tpdiag.probes.rows import extras

    L, P, D, H = 7, 3, 4, 4
    table = torch.randn(L, D)

    def run(span: bool, B: int):
        if not span:
            monkeypatch.setattr(spans, "add_span", lambda *a, **k: False)
        torch.manual_seed(B)
        x = torch.randn(B, L, D)
        heads = torch.randn(B, H, L, 2)
        ref = {"s0/forward/layer/out#0/0": [B, L, D], "s0/forward/rope/out#0/0": [L, D],
               "s0/forward/lin/out#0/0": [B * L, D], "s0/forward/attn/in#0/0": [B, L, D],
               "s0/forward/cache/out#0/0": [B, L, D], "s0/forward/head/out#0/0": [B, L, D],
               "s0/forward/scores/out#0/0": [B, L, L], "s0/forward/col/out#0/0": [B, L, D],
               "s0/forward/heads/out#0/0": [B, H, L, 2]}
        rec = Recorder(mode="hash", piece_ref=ref, world=world, rank=world - 1)
        w = D // world
        spans_ = [(0, P)] + [(t, t + 1) for t in range(P, L)]
        for k, (a, b) in enumerate(spans_):
            rec.begin_piece(k, len(spans_), (a, b, L))
            rec.phase = "forward"
            h = x[:, a:b].clone()
            assert rec.add("out", "layer", "0", h) is not None
            rec.add("in", "attn", "0", h)  # the same tensor: one row shared
            rec.add("out", "rope", "0", table[a:b].clone())
            rec.add("out", "lin", "0", h.reshape(B * (b - a), D))
            rec.add("out", "cache", "0", x[:, :b].clone())  # grows call by call
            # the head on the last row only (generate()'s logits_to_keep=1): [B, 1, D] in every
            # call, not placed in the prompt call (P wide), placed in the one-token calls
            rec.add("out", "head", "0", x[:, b - 1:b].clone())
            # scores over the keys so far [B, q, k]: not placed until the last call's [B, 1, L]
            rec.add("out", "scores", "0", torch.ones(B, b - a, b) * k)
            # this rank's columns (a column-parallel output) and heads (attention by heads)
            rec.add("out", "col", "0", x[:, a:b, (world - 1) * w:world * w].clone())
            hh = H // world
            hd = heads[:, (world - 1) * hh:world * hh, a:b].clone()
            if k == 3:  # the same shape, other strides (one row per sequence: views of it)
                hd = hd.transpose(0, 1).contiguous().transpose(0, 1)
            r = rec.add("out", "heads", "0", hd)
            if k == 2:  # a consumer noted at a later call (module_probes' extras)
                extras(r).setdefault("consumers", []).append("next")
        rec.end_pieces()
        piece_merge.merge(rec)
        monkeypatch.undo()
        return rec

    for B in (2, 1):
        fast, slow = run(True, B), run(False, B)
        fm, sm = [m for m, _ in fast.records], [m for m, _ in slow.records]
        assert fm == sm and len(fm) >= 7
        assert [list(m) for m in fm] == [list(m) for m in sm]  # the keys in the same order
        assert any(m["key"].startswith("s0/forward/head/out#0/0.piece") for m in fm)  # per call
        assert any(m.get("piece_fold") for m in fm) == (B > 1)
        if world > 1:
            shards = {m["module"]: m["hash_layout"] for m in fm if m["kind"] == "out"}
            assert shards["col"] == "shard:2" and shards["heads"] == "shard:1", shards
        assert fast.piece_varying == slow.piece_varying and fast.piece_varying
        assert torch.equal(take_lanes(fast.hashbuf, list(fast.lanes))[0],
                           take_lanes(slow.hashbuf, list(slow.lanes))[0])
        assert fast.hashbuf.n == slow.hashbuf.n  # rows shared alike


class _Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)

    def forward(self, x, *, scale=1.0):
        return self.norm(self.lin(x) * scale)  # returns its child's output: one tensor, two records


class _Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = _Inner()
        self.head = nn.Linear(4, 3)
        self.side = nn.Linear(4, 4)

    def forward(self, x):
        h = self.inner(x, scale=0.5)
        return self.head(h + self.side(h)), h


def _probed(monkeypatch, hooks: bool, user_hook: bool):
    monkeypatch.setenv("TPDIAG_PROBE_HOOKS", "1" if hooks else "0")
    torch.manual_seed(0)
    m = _Outer()
    own = m.side.forward  # an instance-level forward (as accelerate sets): wrapped, then restored
    m.side.forward = lambda x: own(x) * 2
    side_fwd = m.side.forward
    h = m.head.register_forward_hook(lambda mod, a, o: o + 1) if user_hook else None
    rec = Recorder(mode="hash")
    with module_probes(m, rec):
        assert ("forward" in m.inner.__dict__) != hooks and bool(m.inner._forward_hooks) == hooks
        assert bool(m.head._forward_hooks) == (hooks or user_hook)
        rec.phase = "forward"
        y, _ = m(torch.randn(2, 4))
        rec.phase = "backward"
        y.sum().backward()
    if h is not None:
        h.remove()
    for mod in m.modules():  # nothing of the probes left
        assert not mod._forward_hooks and not mod._forward_pre_hooks
        assert mod.__dict__.get("forward") is (side_fwd if mod is m.side else None)
    return rec


@pytest.mark.parametrize("user_hook", [False, True])
def test_modules_probed_through_forward_record_what_hooks_record(monkeypatch, user_hook):
    """wrap_forward (probes/forward_wrap.py: a module without hooks) and hooks: the same records, keys, metas and lanes,
    for keyword arguments, a parent returning its child's output and an instance-level forward;
    a module with a user's hook keeps the hook path (its output seen after the user's hook)."""
    wrapped = _probed(monkeypatch, False, user_hook)
    hooked = _probed(monkeypatch, True, user_hook)
    mw, mh = [m for m, _ in wrapped.records], [m for m, _ in hooked.records]
    assert [list(m.items()) for m in mw] == [list(m.items()) for m in mh]
    keys = [m["key"] for m in mw]
    assert "s0/forward/inner/out#0/0" in keys and "s0/forward/inner.norm/out#0/0" in keys
    assert "s0/backward/inner/grad_out#0/0" in keys and "s0/forward/side/in#0/0" in keys
    lw, lh = _lanes(wrapped), _lanes(hooked)
    assert len(lw) == len(lh) and all(torch.equal(a[0], b[0]) for a, b in zip(lw, lh))
    # the negative control: the user's hook changes what head's output record holds
    if user_hook:
        other = _lanes(_probed(monkeypatch, False, False))
        i = keys.index("s0/forward/head/out#0/0")
        assert not torch.equal(lw[i][0], other[i][0])


def test_a_forward_set_inside_the_block_is_left_in_place():
    m, rec = _Reuse(), Recorder(mode="hash")
    mine = lambda x: x  # noqa: E731
    with module_probes(m, rec):
        assert "forward" in m.lin.__dict__  # the probe's wrapper
        m.lin.forward = mine                # e.g. a user's own patch, made while capturing
    assert m.lin.__dict__.get("forward") is mine and "forward" not in m.__dict__


def test_grad_taps_record_what_register_hook_records(monkeypatch):
    """module_hooks.tap (a module output's grad hook put in the tensor's hook dict, no handle) and
    Tensor.register_hook: the same records and lanes; a user's hooks on the same output keep their
    order around the tap and still run; no tap is left on a tensor after the block."""
    monkeypatch.setenv("TPDIAG_PROBE_TAPS", "1")
    tapped = _probed(monkeypatch, False, False)
    monkeypatch.setenv("TPDIAG_PROBE_TAPS", "0")
    hooked = _probed(monkeypatch, False, False)
    mt, mh = [m for m, _ in tapped.records], [m for m, _ in hooked.records]
    assert [list(m.items()) for m in mt] == [list(m.items()) for m in mh]
    keys = [m["key"] for m in mt]
    # the negative control of the equality: grad records are there to compare
    assert sum("/grad_out#" in k for k in keys) >= 4, keys
    lt, lh = _lanes(tapped), _lanes(hooked)
    assert len(lt) == len(lh) and all(torch.equal(a[0], b[0]) for a, b in zip(lt, lh))

    monkeypatch.setenv("TPDIAG_PROBE_TAPS", "1")
    order, kept = [], []
    lin = nn.Linear(4, 4)
    lin.register_forward_hook(lambda mod, a, o: (o.register_hook(lambda g: order.append("user before")),
                                                 kept.append(o)) and None, prepend=True)
    rec = Recorder(mode="hash")
    with module_probes(lin, rec):
        rec.phase = "forward"
        y = lin(torch.randn(2, 4))
        y.register_hook(lambda g: order.append("user after"))
        rec.phase = "backward"
        real = rec.add
        rec.add = lambda kind, *a, **k: (order.append(kind) if kind == "grad_out" else None, real(kind, *a, **k))[1]
        y.sum().backward()
    assert order == ["user before", "grad_out", "user after"], order
    assert kept[0] is y and len(y._backward_hooks) == 2  # the user's two, the tap taken out
