"""A probed model's modules and parameters, walked once a block, its plan's styles looked up once
(memoised per plan), and the parameter records (record_params): host time a small step pays on
every record otherwise (docs/benchmarks.md, "Probe cost in hash mode"; the cut measured:
`git show d055ef2:docs/benchmarks.md`, "Host work per record, session 8")."""
from __future__ import annotations

import torch
from torch import nn

from tpdiag.probes.recorder import Recorder


def record_params(rec: Recorder, model: nn.Module, kind: str, plan: dict | None = None,
                  include: set[str] | None = None) -> None:
    if not rec.enabled:  # records nothing: no module walk either
        return
    walked = rec._walks.get(id(model)) or Walk(model)
    style = _style_memo(plan)
    add = rec.add
    # the records' own tensor calls skip torch-function modes (module_hooks.py's no_modes says why)
    with torch._C.DisableTorchFunction():
        for mname, short, p, cls in walked.params:
            owner = mname or walked.root
            if include is not None and owner not in include:
                continue
            add(kind, owner, short, p, style=style(mname), cls=cls)


# the bytes of floating buffers buffer_state copies at a step's start, per model: a write the
# version counter cannot see is found by comparing them after the step; buffers past it are
# compared by version counter and tensor only (docs/causes.md says so)
COPY_CAP = 256 << 20


def buffer_state(model: nn.Module) -> dict:
    """Each floating buffer's (tensor id, version counter, a copy of its bytes or None past
    COPY_CAP), by (owner path, short name): what written_since compares against. The copy: an
    in-place c10d collective on a buffer (all_reduce, broadcast) and a write through `.data` move no
    version counter, so a replica synced, or nudged per rank, that way was never recorded."""
    out, left = {}, COPY_CAP
    with torch._C.DisableTorchFunction(), torch.no_grad():
        for n, b in model.named_buffers():
            if not b.is_floating_point():
                continue
            local = getattr(b, "_local_tensor", b)
            size = local.numel() * local.element_size()
            copy = local.detach().clone() if size <= left else None
            left -= size if copy is not None else 0
            out[_split(n)] = (id(b), b._version, copy)
    return out


def written_since(model: nn.Module, before: dict) -> set[str]:
    """The floating buffers (full names) written since `before` (buffer_state): another tensor put
    in, its version counter moved, or its bytes changed where they were copied."""
    out = set()
    with torch._C.DisableTorchFunction(), torch.no_grad():
        for n, b in model.named_buffers():
            if not b.is_floating_point():
                continue
            was = before.get(_split(n))
            if was is None or was[:2] != (id(b), b._version) or not _same_bytes(was[2], b):
                out.add(n)
    return out


def _same_bytes(copy, b) -> bool:
    """b's bytes as the copy holds them (NaN-safe: bits, not values); True where no copy was made
    (the version counter alone then says)."""
    if copy is None:
        return True
    local = getattr(b, "_local_tensor", b).detach()
    if local.shape != copy.shape or local.dtype != copy.dtype or local.device != copy.device:
        return False
    if local.numel() == 0:
        return True
    return torch.equal(local.contiguous().reshape(-1).view(torch.uint8), copy.contiguous().reshape(-1).view(torch.uint8))


def record_written_buffers(rec: Recorder, model: nn.Module, before: dict, plan: dict | None = None,
                           include: set[str] | None = None) -> None:
    """Record, as kind "buffer", every floating buffer the step wrote (in place or reassigned):
    state a training forward keeps for the next step (a load-balancing bias, running statistics)
    is read by later steps like a parameter, yet no parameter record holds it - a replica written
    differently on each rank was seen only at a later step's output, with no input of it differing
    (its cause unknown, or a bug named downstream). Written on ANY rank of the world
    (_written_anywhere): every rank records the same buffers."""
    if not rec.enabled:
        return
    style = _style_memo(plan)
    from tpdiag.records.keys import root_record_name

    root = root_record_name(n for n, _ in model.named_children())
    floating = [(n, b) for n, b in model.named_buffers() if b.is_floating_point()]
    wrote = written_since(model, before)
    marked = _written_anywhere(rec, wrote)
    with torch._C.DisableTorchFunction():
        for n, b in floating:
            if _slot(n) not in marked:
                continue
            mname, short = _split(n)
            if include is not None and (mname or root) not in include:
                continue
            rec.add("buffer", mname or root, short, b, style=style(mname))


# the slots of the buffers' names that one world's ranks agree on (_written_anywhere)
_SLOTS = 1 << 14


def _slot(name: str) -> int:
    import zlib

    return zlib.crc32(name.encode()) % _SLOTS


def _written_anywhere(rec: Recorder, wrote: set[str]) -> set[int]:
    """The slots of the buffers any rank of the world wrote this step, one all-reduce (MAX) of a
    fixed-size map of name slots, so that no rank's buffers (their number, their names) change what
    the ranks exchange. A write a rank makes on its own (a bias nudged only where that rank's own
    load passes a tolerance) left its buffer record on that rank only: the ranks' record streams
    differed and the run read "inconclusive: the model is not SPMD", a wrong replica unnamed. A
    buffer whose name shares a written one's slot is recorded too (the same at every degree: the
    rule is the same where there is no other rank)."""
    import torch.distributed as dist

    slots = {_slot(n) for n in wrote}
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return slots
    from tpdiag.base.gloo_release import settle

    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    # the map's own ops and collective are no records, and skip torch-function modes (record_params)
    with rec._paused(), torch._C.DisableTorchFunction():
        flags = torch.zeros(_SLOTS, dtype=torch.uint8, device=dev)
        if slots:
            flags[torch.tensor(sorted(slots), device=dev)] = 1
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        settle([flags])
        return set(flags.nonzero().flatten().tolist())


def _split(name: str) -> tuple[str, str]:
    mname, _, short = name.rpartition(".")
    return mname, short


class Walk:
    """A model's modules and parameters, walked once per module_probes block (record_params
    reads it twice a step): names by module, classes by name, parameters with their owner."""
    __slots__ = ("names", "classes", "params", "paths", "root")

    def __init__(self, model: nn.Module):
        from tpdiag.records.keys import root_record_name

        # the root's record name: "model", or "(root)" where a child is named "model" (HF's
        # CausalLM.model keeps it: records/keys.ROOT_NAMESAKE)
        self.root = root = root_record_name(n for n, _ in model.named_children())
        self.names = {}
        self.paths = {}      # by module: its path ("" for the root)
        self.classes = {}    # by record name
        raw = {}             # by module path ("" for the root)
        for n, m in model.named_modules():
            c = type(m).__name__
            self.names[m] = n or root
            self.paths[m] = n
            self.classes[n or root] = c
            raw[n] = c
        root = type(model).__name__
        self.params = []     # (owner path, short name, parameter, owner class)
        for pname, p in model.named_parameters():
            mname, _, short = pname.rpartition(".")
            self.params.append((mname, short, p, raw.get(mname, root)))


_STYLE_MEMOS: dict = {}


def _style_memo(plan: dict | None):
    """style_of(name, plan), memoised per plan: the plan's fnmatch patterns were matched against
    every module and parameter name twice a step (host time a small step pays). Keyed by the
    plan's patterns and its style objects, which the memo keeps alive (their ids stay theirs)."""
    from tpdiag.records.styles import style_of

    return _memo(plan, "style", lambda name, plan: style_of(name, plan))


def plan_memo(plan: dict | None):
    """name -> (style, output partial, output grad partial) under the plan, memoised as
    _style_memo (the partial flags were matched per module name on every module_probes entry)."""
    from tpdiag.records.styles import output_grad_partial, output_partial, style_of

    return _memo(plan, "info", lambda name, plan: (style_of(name, plan), output_partial(name, plan),
                                                   output_grad_partial(name, plan)))


def _memo(plan: dict | None, what: str, fn):
    plan = plan or {}
    key = (what, tuple((k, id(v)) for k, v in plan.items()))
    hit = _STYLE_MEMOS.get(key)
    if hit is None:
        if len(_STYLE_MEMOS) > 64:
            _STYLE_MEMOS.clear()
        memo: dict = {}

        def get(name: str, _plan=dict(plan)):
            s = memo.get(name, memo)
            if s is memo:
                s = memo[name] = fn(name, _plan)
            return s

        hit = _STYLE_MEMOS[key] = get
    return hit
