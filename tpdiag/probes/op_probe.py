"""Per-op records: a TorchDispatchMode that records the output of every compute op.

Ops are attributed to the innermost module whose forward is running (forward), else to the
phase (loss, backward, optimizer), and named by op and occurrence within that module's call, so the
alignment survives extra ops at TP > 1 (collectives, redistributes): those are simply keys the
reference lacks. Under DTensor the mode sees DTensor-level ops (local shard + placement) and the
functional collectives that redistributions issue. It only observes: outputs are returned as is.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from tpdiag.base.user_code import calling_line
from tpdiag.probes.float64_mode import DISCRETE
from tpdiag.probes.recorder import PHASES, Recorder
from tpdiag.probes.rows import extras
from tpdiag.records.keys import record_key

# Metadata and aliasing ops produce no new numbers; recording them only adds noise.
_SKIP = {"view", "_unsafe_view", "t", "transpose", "permute", "expand", "slice", "select",
         "detach", "alias", "split", "split_with_sizes", "unsqueeze", "squeeze", "as_strided",
         "unbind", "chunk", "clone", "_to_copy", "empty_like", "zeros_like", "ones_like",
         "empty", "zeros", "ones", "full", "fill_", "lift_fresh", "arange", "new_empty",
         # allocations (autograd clones a grad it cannot steal through new_empty_strided + copy_:
         # whether it can depends on who still holds the grad - per rank, per run)
         "empty_strided", "new_empty_strided",
         "new_zeros", "copy_", "is_same_size", "_has_compatible_shallow_copy_type", "view_as",
         "contiguous", "zero_", "resize_", "set_", "_local_scalar_dense"}
# ...except a pick of the model's own tensor (a RoPE table's rows, a parameter's columns taken in
# a forward: slice, select; index and index_select, floating ops recorded anyway): it is recorded
# with its source, once. A pick computes no number, so where its source is the same at both sides
# a different result is a different pick - a wrong position or shard, which nothing else recorded
# would show (tests/models/planted/rope_decode.py, diff/judge.py). Copied: the source may be
# written in place later.
_PICKS = {"slice", "select", "index", "index_select"}


class OpProbe(TorchDispatchMode):
    """`with OpProbe(rec, include=..., model=...)`. With `model` and an include of module names
    only, the mode is pushed only while an included module's call runs (`_Scoped`), not for the
    whole step: the same records, without every other op of the model paying a Python dispatch
    (a decode world's region pass: ~2,100 ops a call, 1,025 calls, for a few dozen recorded)."""

    def __init__(self, rec: Recorder, include: set[str] | None = None, oracle: bool = False,
                 model=None):
        super().__init__()
        self.rec = rec
        self.occ: dict = {}
        self.top: dict = {}  # (step, phase, module, op) -> one past the pieces' highest occurrence
        # `--granularity auto`: ops only inside the first divergent module (or phase)
        self.include = include
        # the reference world of a second pass: every recorded op also re-executed in float64
        # (probes/float64.py) and recorded as kind "oracle" under the op's record name
        self.oracle = oracle
        self._scoped = _Scoped.of(self, model, include)
        self._model, self._tensors, self._sources = model, None, set()

    def __enter__(self):
        self._own_tensors()
        if self._scoped is not None:
            self._scoped.install()
            return self
        return super().__enter__()

    def __exit__(self, *exc):
        if self._scoped is not None:
            self._scoped.remove()
            return None
        return super().__exit__(*exc)

    def _owned(self, args):
        """The model's plain parameter or buffer that args[0] is (a view of), while the step has
        not written it in place since the probe was entered (a preallocated cache is activations,
        not the model's own numbers); else None."""
        src = args[0] if args else None
        if self._tensors is None or type(src) not in (torch.Tensor, torch.nn.Parameter) \
                or not src.is_floating_point() or src.layout != torch.strided or src.is_meta:
            return None
        hit = self._tensors.get(src.untyped_storage().data_ptr())
        return hit[0] if hit is not None and src._version == hit[1] else None

    def _own_tensors(self) -> None:
        if self._model is None:
            return
        import itertools

        self._tensors = {t.untyped_storage().data_ptr(): (t, t._version) for t in itertools.chain(
            self._model.parameters(), self._model.buffers())
            if type(t) in (torch.Tensor, torch.nn.Parameter) and t.numel() and t.is_floating_point()
            and t.layout == torch.strided and not t.is_meta}

    def _wanted(self, module: str) -> bool:
        if self.include is None:
            return True
        return any(module == m or module.startswith(m + ".") for m in self.include)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if not self.rec.enabled:
            return out
        src = self._owned(args) if name in _PICKS else None
        if name in _SKIP and src is None:
            return out
        rec = self.rec
        module = rec.stack[-1] if (rec.phase == "forward" and rec.stack) else rec.phase
        if not self._wanted(module):
            return out
        ns = getattr(func, "namespace", "aten")
        op = f"{ns}::{name}"
        # a module's ops are keyed by its call (op#C) and counted within it: the n-th slice of call 1
        # is the reference's n-th slice of call 1. Counted across calls, one op only a degree runs
        # (a rank's slice of a weight: a full slice at TP=1 dispatches none) shifted every later
        # call's numbers - a block applied twice paired its second call's weight slice with the
        # reference's first one of another weight and read a false BUG (loop_stage.py:loop_ok)
        call = rec.stack_calls[-1] if rec.phase == "forward" and rec.stack and len(rec.stack_calls) == len(rec.stack) else 0
        # occurrences count per piece (a micro-batch, a decode call), as the modules' call
        # indices do: piece k's n-th matmul of a module is the slice of the reference's n-th. A
        # piece starts after what was recorded before the pieces, and what comes after them (the
        # step's loss) after the pieces' highest count: no key is recorded twice
        base = (rec.step, rec.phase, module, call, op)
        if rec.piece is None:
            k = max(self.occ.get(base, 0), self.top.get(base, 0))
            self.occ[base] = k + 1
        else:
            pk = base + (rec.piece,)
            k = self.occ.get(pk, self.occ.get(base, 0))
            self.occ[pk] = k + 1
            self.top[base] = max(self.top.get(base, 0), k + 1)
        flat, _ = tree_flatten(out)
        if ns == "_c10d_functional" and name != "wait_tensor":
            # An asynchronous collective's output holds its numbers only after wait_tensor (on
            # gloo it changed from run to run when recorded here), and its user may wait inside
            # a tensor subclass's dispatch, out of this mode's sight. Waiting now changes no
            # number (a later wait finds nothing pending); on CUDA it only orders the streams.
            for t in flat:
                if isinstance(t, torch.Tensor):
                    torch.ops._c10d_functional.wait_tensor(t)
        elif ns == "c10d":
            # The in-place collectives (`c10d::_allgather_base_`, `allreduce_`, ...: what
            # dist.all_gather_into_tensor and kin dispatch) return (tensors, Work) with the work
            # still running on gloo's thread: a copy taken now held part of the numbers, a
            # different part in every run. Wait on the Work first (the caller's own wait then
            # finds it done; on CUDA a wait only orders the streams).
            _wait_works(flat)
        # An in-place or out= op's result is a tensor seen before whose version counter is bumped
        # only after this mode returns (ADInplaceOrView runs above it): recorded as is it would
        # pass for the earlier, unchanged record (and a queued hash would find it changed). A copy
        # of its new value is its record.
        mutable = func._schema.is_mutable or name in _PICKS
        # a discrete choice on floating values (argmax, top-k indices, a comparison) is recorded
        # too: equal choices on both sides rule out a flipped near tie (diff/oracle.py)
        choice = name in DISCRETE and any(isinstance(a, torch.Tensor) and a.is_floating_point()
                                          for a in tree_flatten((args, kwargs))[0])
        if src is not None and (module, call, op, k) not in self._sources:
            # the source, once: that it is the same at both sides is what makes a different pick
            # a wrong one (diff/judge.py); a parameter or buffer the step has not written
            self._sources.add((module, call, op, k))
            rec.add("op", module, f"{op}#{k}.src", src.detach().clone(), call=call)
        at = None
        for i, t in enumerate(x for x in flat if isinstance(x, torch.Tensor)):
            # complex outputs too: a RoPE's complex product (torchtitan's freqs_cis) is where its
            # numbers are made; without it the first op that differs was the view_as_real after it,
            # whose float64 re-execution from the reference's own input is exact - it judged nothing
            if t.is_floating_point() or t.is_complex() or choice:
                t = written(name, i, t, args)
                r = rec.add("op", module, f"{op}#{k}.{i}", t.detach().clone() if mutable else t, call=call)
                if r is not None:
                    # the line of the user's code that ran it: `aten::mul` alone does not say
                    # which of a forward's muls made the difference
                    at = at or calling_line()
                    if at:
                        extras(r)["at"] = at
        if self.oracle and rec.phase == "forward" and any(
                isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex()) for x in flat):
            self._oracle(func, args, kwargs, module, f"{op}#{k}", call)
        return out

    def _oracle(self, func, args, kwargs, module: str, name: str, call: int = 0) -> None:
        from tpdiag.probes.float64 import op_oracle

        rec = self.rec
        rec.enabled = False
        try:
            from tpdiag.probes.oracle_hooks import timed

            with timed(rec):
                out64, why = op_oracle(func, args, kwargs)
        finally:
            rec.enabled = True
        if why is not None:
            rec.oracle_notes[record_key(rec.step, rec.phase, module, "oracle", call, name)] = {"why": why}
            return
        flat, _ = tree_flatten(out64)
        for i, t in enumerate(x for x in flat if isinstance(x, torch.Tensor)):
            if t.is_floating_point() or t.is_complex():
                rec.add("oracle", module, f"{name}.{i}", written(func.overloadpacket.__name__, i, t, args), call=call)


# Outputs a kernel allocates past what it writes: memory-efficient attention's log-sum-exp has its
# query rows rounded up to 32 per head, and only the first L are the softmax's (the rest is whatever
# the memory held - on 2x H200 a correct float32 model with 8 positions read `non-finite` at
# `_scaled_dot_product_efficient_attention#0.1`). {op: the query rows it wrote, from its args}
_ROWS_WRITTEN = {
    "_scaled_dot_product_efficient_attention": lambda args: args[0].shape[-2],  # query [B, H, L, E]
    # query [B, M, H, K]; varlen (cu_seqlens_q given): rows up to max_seqlen_q
    "_efficient_attention_forward": lambda args: (args[6] if len(args) > 6 and args[4] is not None
                                                  and isinstance(args[6], int) else args[0].shape[1]),
}


def written(name: str, i: int, t: torch.Tensor, args) -> torch.Tensor:
    """The part of output i of op `name` that the op wrote: all of it but the rows _ROWS_WRITTEN cuts."""
    rows = _ROWS_WRITTEN.get(name)
    if rows is None or i != 1 or t.dim() < 1:
        return t
    try:
        n = int(rows(args))
    except (IndexError, TypeError, AttributeError):
        return t
    return t[..., :n].contiguous() if 0 <= n < t.shape[-1] else t


class _Scoped:
    """The mode pushed around each call of the included modules (hooks: the first pre-hook and the
    last forward hook, so a TP style's input/output redistributions inside the call are seen as
    under a mode held for the whole step) - nested included calls push it once."""

    def __init__(self, probe: OpProbe, mods: list):
        self.probe, self.mods, self.depth, self.handles = probe, mods, 0, []

    @classmethod
    def of(cls, probe: OpProbe, model, include):
        if model is None or not include:
            return None
        named = dict(model.named_modules())
        # records name the root "model" (named_modules: ""), or "(root)" where a child is named
        # "model" (HF's): the root's own ops (a logit softcap) need the mode held for the whole step
        if any(n in PHASES or n == "model" or n not in named for n in include):
            return None  # a phase's ops (loss, backward), or a name the hooks cannot reach
        return cls(probe, [named[n] for n in sorted(include)])

    def _pre(self, *_):
        self.depth += 1
        if self.depth == 1:
            TorchDispatchMode.__enter__(self.probe)

    def _post(self, *_):
        self.depth -= 1
        if self.depth == 0:
            TorchDispatchMode.__exit__(self.probe, None, None, None)

    def install(self) -> None:
        for m in self.mods:
            self.handles.append(m.register_forward_pre_hook(self._pre, prepend=True))
            self.handles.append(m.register_forward_hook(self._post, always_call=True))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        while self.depth > 0:  # a call that raised inside a nested pre-hook
            self._post()


def _wait_works(flat) -> None:
    from torch.distributed.distributed_c10d import Work

    for x in flat:
        if isinstance(x, torch.ScriptObject):
            try:
                w = Work.unbox(x)
            except (RuntimeError, TypeError):  # another script object: not a collective's work
                continue
            if w is not None:  # NCCL (torch 2.11) boxes an in-place collective's work as None here
                w.wait()
