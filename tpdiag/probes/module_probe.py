"""Module-level probes: forward inputs/outputs, output grads, parameter grads.

Hooks observe only: no tensor is replaced and no autograd node is inserted, so the probed run
computes exactly what the unprobed run computes (grads of a tensor used by several modules
are accumulated in the same order). A module with no forward hooks of its own is probed through
a wrapper of its `forward` instead of hooks (probes/forward_wrap.py: the same calls see the same
arguments and outputs, at less host time; TPDIAG_PROBE_HOOKS=1 uses hooks everywhere).
Everything registered or wrapped is undone on exit.
"""
from __future__ import annotations

import gc
import os
from contextlib import contextmanager

import torch
from torch import nn

from tpdiag.probes.oracle_hooks import (grad_out_differs, inputs_differ, oracle_backward_hook, record_oracle,
                                        record_own_oracles)
from tpdiag.probes.forward_wrap import global_module_hooks, unwrap, wrap_forward
from tpdiag.probes.model_walk import Walk, plan_memo
from tpdiag.probes.module_hooks import grad_hook, hook_tensors, no_modes, param_grad_hook, tap
from tpdiag.probes.own_pass import OwnFiles, children_of
from tpdiag.probes.producer_index import add_producer, producers_of
from tpdiag.probes.recompute import Recomputes
from tpdiag.probes.recorder import Recorder
from tpdiag.probes.rows import extras, module_of

_NIDX = 16
_IDX = tuple(str(i) for i in range(_NIDX))  # output / input positions as record names


@contextmanager
def module_probes(model: nn.Module, rec: Recorder, plan: dict | None = None,
                  backward: bool = True, include: set[str] | None = None,
                  oracle: set[str] | None = None, own: dict[str, str] | None = None):
    """own: {label: file} of other worlds' whole inputs and output grads; each oracle module is
    re-executed from those too (probes/oracle_hooks.record_own_oracles).
    oracle: modules whose every call is also re-executed in float64 (probes/float64.py) from a
    snapshot of its inputs, recorded as kind "oracle" beside its outputs (the reference world of
    a second pass; diff/oracle.py judges bug or rounding from it)."""
    # Python's cyclic GC paused while the hooks go in and are in (TPDIAG_PROBE_GC=1: left
    # alone). A step leaves ~1000 records' dicts, lists and closures alive, enough to trigger
    # full (oldest generation) collections that walk every tracked object of the process -
    # torch, the model, the records: 0.2-0.6 s each on a 2-core host (`probes host`), one every
    # few probed steps, a step time's spread on a host-bound step. The probes make no reference
    # cycles of their own; garbage in cycles waits until the hooks come out, one step. Paused
    # before the hooks go in: the ~900 handles, closures and weakrefs made then collect too.
    gc_was = gc.isenabled() and os.environ.get("TPDIAG_PROBE_GC") != "1"
    if gc_was:
        gc.disable()
    handles = []
    producers = None
    # grad hooks put in by tap: (hook dict, key), taken out on exit (TPDIAG_PROBE_TAPS=0:
    # Tensor.register_hook for every output, A/B)
    taps = [] if os.environ.get("TPDIAG_PROBE_TAPS", "1") != "0" else None
    wrapped: list = []  # (module, its own instance `forward` or _NONE, the wrapper): undone on exit
    walks = rec._walks
    walked = None
    try:
        info = plan_memo(plan)
        walked = Walk(model)
        classes = walked.classes
        root = walked.root  # the root's outputs are the model's: no module consumes them
        # per module: (name, style, output partial, output grad partial, class) - one lookup per
        # hook call (host time per record). The class is looked up by record name (the root's is
        # "(root)" where a child is named "model": model_walk.Walk.root)
        infos = {m: (n, *info(n), classes[n]) for m, n in walked.names.items()}
        # Which modules consumed each output: a grad_out is computed by its consumers' backward.
        # Keyed by the tensor and by its storage's base tensor, each to the records of every module
        # that returned it (a parent returning its child's output, HF's LlamaModel returning its
        # final norm's): a consumer that reads a view (`hidden[:, -k:]` before a causal LM head,
        # a reshape) is linked to the modules whose output it views. id(tensor) -> (weakref, metas):
        # a WeakTensorKeyDictionary builds a Python key object per lookup, ~3 lookups per module
        # call (host time per record); the weakref tells a live entry from a dead tensor's id reused.
        producer: dict = {}

        def producers(t) -> list:
            return [module_of(m) for m in producers_of(producer, t)]

        rec.producers = producers
        # this call's index per module, pairing its outputs with its inputs (a plain dict: an
        # attribute set on the module goes through nn.Module.__setattr__, ~10 us per call)
        calls: dict = {}
        stack, stack_calls = rec.stack, rec.stack_calls
        add = rec.add
        counts = rec._calls

        snaps: dict = {}  # (module, call) -> float64 snapshot of its inputs (oracle modules)
        # [step, the model's buffers and parameters by storage] (float64.state_names), once a step:
        # which other module's state a re-executed call read
        state_names: list = [None, None]
        copies: dict = {}  # the buffers' copies those take, one per unchanged buffer (buffers_before)
        # (step, module, short) -> the float64 weight grads held until the real one is
        # accumulated (oracle_hooks.param_grad_norms), for the weight grad hooks put in below
        pend: dict = {}
        hooked: dict = {}
        # (step, module, short) -> {label: [shipped record, float64 grads]}: the same for the weight
        # grads re-executed from another world's inputs (probes/own_side_norms.py)
        side_pend: dict = {}
        files = OwnFiles(own)

        def grad_pend(g, name: str, call: int) -> None:
            """A module called once whose output grad differs at every world: the diff reads its
            weight grads' re-execution for two norms only (grads_equal is false there) - the
            embedding's, whose inputs (the tokens) are equal, ~0.5 GB of float64 at llama-1b. A
            module called more than once is left to its inputs (its calls' grads would part)."""
            if os.environ.get("TPDIAG_OWN_NORMS", "1") == "0" or counts.get((rec.step, "forward", name), 0) != 1:
                return
            if any(k not in pend for k in ((rec.step, name, s) for s in hooked.get(name, ()))) \
                    and grad_out_differs(rec, g, name, call, files.inputs()):
                for short in hooked.get(name, ()):
                    pend.setdefault((rec.step, name, short), [])

        # which forward call each recompute is (probes/recompute.py); (step, module, call) -> the
        # snapshot of a forward call that ran without a graph
        recomputes = Recomputes()
        no_graph: dict = {}
        # A module called more than once in a step, in a reentrant activation checkpoint (its forward
        # ran without a graph): each segment's backward is an inner backward of its own, and each
        # adds into the weight's .grad - the accumulate hook fired once per segment and the step
        # recorded `param_grad ... listed twice` (ckpt_twice.py:twice_ok: the reference failed,
        # the run inconclusive). Such a weight's grad is held and recorded once, as the step's
        # backward ends (flush_held, queued from a recompute, which runs in that backward).
        no_grad_calls: set = set()  # (step, module) called with grad off where a backward follows
        held: dict = {}  # (step, module, short) -> (the parameter, its record function)
        twice_at = [None]  # the step whose flush is queued, until it runs

        def hold(mname: str, short: str, p, record) -> bool:
            # counts: this piece's forward calls (Recorder.begin_piece starts them again)
            if (rec.step, mname) not in no_grad_calls or counts.get((rec.step, "forward", mname), 0) < 2:
                return False
            held[(rec.step, mname, short)] = (p, record)
            if twice_at[0] != rec.step:
                # no recompute queued the flush (a call under torch.no_grad, no checkpoint): this
                # hook runs in the step's one backward
                twice_at[0] = rec.step
                torch.autograd.Variable._execution_engine.queue_callback(lambda step=rec.step: flush_held(step))
            return True

        def flush_held(step) -> None:
            twice_at[0] = None  # a later backward of the step (the next micro-batch's) queues its own
            for k in [k for k in held if k[0] == step]:
                p, record = held.pop(k)
                record(p)
            for k in [k for k in no_grad_calls if k[0] == step]:
                no_grad_calls.discard(k)

        multi_out: set = set()  # modules that returned several floating tensors (children_of)

        def pre_hook(mod, args, kwargs):
            if rec.in_oracle:  # an oracle re-execution runs this module's children: no records
                return None
            if torch._C._current_graph_task_id() != -1:
                # a forward inside the backward: activation checkpointing recomputing what the
                # step's forward already ran and recorded (gradient_checkpointing_enable()). Not a
                # call of the step: recorded, it numbered every checkpointed module's calls twice
                # and a capture with it could not be diffed against one without
                if backward:
                    recomputes.recompute(rec.step, mod, infos[mod][0], hook_tensors(args, kwargs))
                    if twice_at[0] != rec.step and any(k[0] == rec.step for k in no_grad_calls):
                        # here the step's own (outer) backward runs: its end comes after every
                        # segment's inner backward (reentrant), where the held weight grads are final
                        twice_at[0] = rec.step
                        torch.autograd.Variable._execution_engine.queue_callback(
                            lambda step=rec.step: flush_held(step))
                return None
            name, style, _, _, cls = infos[mod]
            # = rec.call_index(name), inline (host time per module call)
            ck = (rec.step, rec._phase, name)
            call = calls[mod] = counts.get(ck, 0)
            counts[ck] = call + 1
            if backward and not torch.is_grad_enabled():
                recomputes.forward(rec.step, mod, name, call, hook_tensors(args, kwargs))
                no_grad_calls.add((rec.step, name))
            stack.append(name)
            stack_calls.append(call)
            if oracle and name in oracle and rec.enabled:
                from tpdiag.probes.float64 import buffers_before, snapshot

                # its buffers too: a forward that writes them is re-executed from what it read
                snaps[(mod, call)] = (snapshot((args, kwargs or {})), buffers_before(mod, copies))
            with no_modes():
                for i, t in enumerate(hook_tensors(args, kwargs)):
                    add("in", name, _IDX[i] if i < _NIDX else str(i), t, call=call, style=style, cls=cls)
                    srcs = producers_of(producer, t)
                    if srcs:
                        for src in srcs:
                            m = module_of(src)
                            if m != root and not name.startswith(m + "."):
                                extras(src).setdefault("consumers", []).append(name)
            return None

        perturb = os.environ.get("TPDIAG_TEST_PERTURB_PROBE")  # fault injection for the self-check
        if perturb and perturb.startswith("full:"):  # only under full capture (the region pass)
            perturb = perturb[len("full:"):] if rec.mode == "full" else None
        if perturb and "@" in perturb:  # NAME@N: only in the TP=N world
            name_, _, n = perturb.partition("@")
            perturb = name_ if str(rec.world) == n else None

        def fwd_hook(mod, args, kwargs, out):
            if rec.in_oracle:
                return None
            name, style, part_out, part_grad, cls = infos[mod]
            if torch._C._current_graph_task_id() != -1:
                # the recompute (pre_hook): its outputs' grads are the step's where the backward
                # runs through them (reentrant checkpointing: the forward ran without a graph), as
                # the forward's call it recomputes
                call = recomputes.recompute_done(rec.step, mod, name)
                # the float64 backward of an oracle module whose forward call had no graph to hook
                # (reentrant: the forward ran under no_grad) is hooked here, from that call's snapshot
                # (without it the checkpointed block's input grads went unjudged and a grad the
                # backward carries down read a false sharding-bug)
                later = no_graph.pop((rec.step, name, call), None) if no_graph else None
                if later is not None and backward:
                    oracle_backward_hook(rec, mod, name, call, later[0], out, handles, cls, pend,
                                         (lambda g, name=name, call=call: grad_pend(g, name, call)) if own else None,
                                         buffers=later[1])
                if backward:
                    for i, t in enumerate(hook_tensors(out)):
                        if t.requires_grad and t.grad_fn is not None:
                            idx = _IDX[i] if i < _NIDX else str(i)
                            handles.append(t.register_hook(grad_hook(rec, name, idx, call, style, cls, None,
                                                                      part_grad)))
                return None
            if stack and stack[-1] == name:
                stack.pop()
                stack_calls.pop()
            if recomputes.open is not None:
                recomputes.forward_done(mod)
            if perturb == name and isinstance(out, torch.Tensor):
                out = out * (1 + 2.0 ** -10)
            call = calls.get(mod, 0)
            snap, bufs = snaps.pop((mod, call), (None, None)) if snaps else (None, None)
            if snap is not None:
                # its inputs differ at every other world: the diff reads the reference's own
                # re-execution for two norms only (probes/oracle_hooks.NORMS); TPDIAG_OWN_NORMS=0:
                # the float64 values whole (the A/B: tests/test_own_norms.py)
                differ = False
                if own and os.environ.get("TPDIAG_OWN_NORMS", "1") != "0":
                    with rec._paused():  # its comparisons are no ops of the step (an op probe's scope)
                        differ = inputs_differ(rec, snap, name, call, files.inputs())
                if differ and backward:
                    for short in hooked.get(name, ()):
                        pend.setdefault((rec.step, name, short), [])
                if state_names[0] != rec.step:
                    from tpdiag.probes.float64 import state_names as names_of

                    state_names[:] = [rec.step, names_of(model)]
                record_oracle(rec, mod, name, call, snap, style, cls, norms_of=out if differ else None, buffers=bufs,
                              path=walked.paths.get(mod, name), oracle=oracle, names=state_names[1])
                # the own-input pass: its children's output grads in its float64 backward, the exact
                # value of one that leaves a child by this module's own code (diff/oracle_own.py)
                kids = children_of(mod, infos, multi_out, counts, rec.step, files.taps()) if own else None
                if own:
                    # once a call: an activation checkpoint's recompute returned above (made again
                    # there, its float64 grads were the same records twice - "grad_in.0.c0@2 listed
                    # twice": a correct checkpointed model read "not judged", gate 2)
                    record_own_oracles(rec, mod, name, call, snap, files.inputs(), style, cls, backward,
                                       side_pend, hooked, buffers=bufs, taps=kids, path=walked.paths.get(mod))
                if backward:
                    if not any(t.grad_fn is not None for t in hook_tensors(out)):
                        # no graph (a reentrant checkpoint's forward): hooked at its recompute
                        for k in [k for k in no_graph if k[0] != rec.step]:
                            del no_graph[k]  # never recomputed (a frozen module under no_grad): dropped
                        no_graph[(rec.step, name, call)] = (snap, bufs)
                    else:
                        oracle_backward_hook(rec, mod, name, call, snap, out, handles, cls, pend,
                                             (lambda g, name=name, call=call: grad_pend(g, name, call)) if own else None,
                                             buffers=bufs, taps=kids)
            with no_modes():
                outs = hook_tensors(out)
                if len(outs) > 1 and own and sum(1 for t in outs if t.is_floating_point()) > 1:
                    multi_out.add(name)  # no float64 backward of it: an ancestor's taps its children
                for i, t in enumerate(outs):
                    idx = _IDX[i] if i < _NIDX else str(i)
                    meta = add("out", name, idx, t, call=call, style=style, cls=cls,
                               layout="partial" if part_out else None)
                    if meta is not None:
                        add_producer(producer, t, meta)
                    if backward and t.requires_grad and t.grad_fn is not None:
                        hook = grad_hook(rec, name, idx, call, style, cls, meta, part_grad)
                        if taps is None or type(t) is not torch.Tensor:
                            handles.append(t.register_hook(hook))
                        else:
                            tap(t, hook, taps)
            return out if perturb == name else None

        # TPDIAG_PROBE_HOOKS=1: every module through hooks (the path before wrap_forward)
        plain_calls = not global_module_hooks() and os.environ.get("TPDIAG_PROBE_HOOKS") != "1"
        for mod, (name, *_) in infos.items():
            if include is not None and name not in include:
                continue
            if plain_calls and not (mod._forward_pre_hooks or mod._forward_hooks) \
                    and wrap_forward(mod, pre_hook, fwd_hook, wrapped):
                continue
            # prepend: see the input as the previous module produced it, before a TP style's
            # own pre-hook converts it to a DTensor.
            handles.append(mod.register_forward_pre_hook(pre_hook, with_kwargs=True, prepend=True))
            handles.append(mod.register_forward_hook(fwd_hook, with_kwargs=True))
        if backward:
            for mname, short, p, _ in walked.params:
                mname = mname or walked.root
                if include is not None and mname not in include or not p.requires_grad:
                    continue
                hooked.setdefault(mname, []).append(short)
                handles.append(p.register_post_accumulate_grad_hook(
                    param_grad_hook(rec, mname, short, info(mname)[0], classes.get(mname), pend, side_pend,
                                     hold)))
        # record_params inside this block reads the same walk (no module walk per call)
        walks[id(model)] = walked
        from tpdiag.probes.collectives import forget_written

        with forget_written(rec):
            yield rec
    finally:
        if producers is not None and rec.producers is producers:
            rec.producers = None
        if walked is not None and walks.get(id(model)) is walked:
            del walks[id(model)]
        for h in handles:
            h.remove()
        for hooks, key in taps or ():
            hooks.pop(key, None)
        unwrap(wrapped)
        if gc_was:
            gc.enable()
