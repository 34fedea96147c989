"""The float64 re-execution of an optimizer step without an update rule in tpdiag, made while the
capture records it.

tpdiag re-runs torch's SGD, Adam and AdamW from their update rule written out (diff/optim_rerun.py);
a user's own `torch.optim.Optimizer` subclass (Lion, Adafactor, Muon) has no rule tpdiag knows, and
`tpdiag diff` cannot import the user's script; torch's other optimizers (RMSprop, Adagrad, its own
Adafactor and Muon) have none written out either. So the optimizer's OWN `step()` runs again here,
at the step pre-hook, on a shadow of the optimizer: float64 copies of each parameter, its grad and its state,
each DTensor gathered WHOLE first (Muon orthogonalises the whole matrix: a Newton-Schulz run on each
rank's shard is another function, and only a re-execution on the whole tensor tells the two apart),
the same param_groups (hyper-parameters) and attributes. Every op runs in float64 (a `.bfloat16()`
in the step becomes float64: probes/float64_mode.py), as one process without a process group runs
it - the TP=1 semantics the reference has:

- no collective: any c10d op refuses (the whole tensors are already here; an all-reduce or
  all-gather of them would count them once per rank), `dist.is_initialized()` reads False and
  `dist.get_rank()` raises (a step that asks for its rank is refused, not run as rank 0);
- no write to anything of the real run (its parameters, grads, state, tensors the optimizer holds),
  no random draw, no closure (`step(closure)` runs the model again);
- the shadow's Python attributes are the optimizer's, containers copied one level deep.

What refuses is one line in world.json (`optimizer_steps[].f64.refused`), the same on every rank of
the TP group (the decision is all-reduced: every rank records the same records). diff/optim_step.py
judges each side's parameter after the step against its own re-execution."""
from __future__ import annotations

import copy
from collections import OrderedDict, defaultdict

import torch

from tpdiag.probes.float64_mode import Float64Mode, OracleRefused, storage_ptr

# a comparison or a sign a rounding-level change of its input can flip: the step then jumps
# (Lion's sign(update) moves an element by 2 lr), and a far result is not shown to be a bug
JUMPS = {"sign", "sgn", "signbit", "heaviside", "round", "floor", "ceil", "trunc", "frac"}


# The shadow holds every parameter it steps WHOLE in float64, with its grad and state: on a real-size
# model (8B parameters with two moments: ~256 GB) that is more than a GPU or a host has, and an
# out-of-memory in the hook would end the user's run. Above this many MiB the step is refused
# (not judged, one line why); TPDIAG_OPT_F64_MAX_MB raises it.
MAX_MB_ENV, MAX_MB = "TPDIAG_OPT_F64_MAX_MB", 4096


def max_mb() -> int:
    """TPDIAG_OPT_F64_MAX_MB (MiB; unset or empty: MAX_MB); a value that is no whole number is BadInput
    (compare checks it before any world: runner/checks.py)."""
    from tpdiag.base.env import whole

    return whole(MAX_MB_ENV, MAX_MB, " of MiB")


def shadow_bytes(opt) -> int:
    """The float64 bytes the shadow would hold: each parameter whole, its grad, its floating state,
    each counted at the parameter's whole size - numbers every rank of the TP group reads alike (a
    DTensor's numel is the whole tensor's), so every rank refuses or none starts the gathers."""
    n = 0
    for group in opt.param_groups:
        for p in group["params"]:
            k = 1 + (p.grad is not None) + sum(1 for v in opt.state.get(p, {}).values()
                                               if isinstance(v, torch.Tensor) and v.is_floating_point()
                                               and v.numel() > 1)
            n += 8 * k * p.numel()
    return n


# torch's optimizers diff/optim_rerun.py re-runs from their update rule written out (its RERUN, which
# tests/test_own_optim.py holds equal to this): the diff judges those by the rule, not by a shadow
RULE = frozenset({"torch.optim.adamw.AdamW", "torch.optim.adam.Adam", "torch.optim.sgd.SGD"})
# torch's optimizers whose step is no function of the parameters, grads and state the capture
# holds: refused, their reason recorded, rather than run on float64 copies
NEVER = {
    # its step(closure) re-evaluates the loss up to max_eval times: the line search reads
    # the model's forward at points no record holds
    "torch.optim.lbfgs.LBFGS": "LBFGS steps through its closure (the model and loss re-run at each "
                               "line-search point): no function of the recorded parameters, grads and state",
}


def _qualified(cls) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def class_name(opt) -> str:
    return _qualified(type(opt))


def _never(opt) -> str | None:
    """NEVER's reason for the optimizer's class or a class it derives from (a user's subclass of
    LBFGS steps through the same closure)."""
    return next((NEVER[_qualified(c)] for c in type(opt).__mro__ if _qualified(c) in NEVER), None)


def applies(opt) -> bool:
    """Whether the capture re-executes this optimizer's step in float64: a user's own class and
    torch's own without a rule (RMSprop, Adagrad, Adafactor, Muon...) - NEVER's are refused there."""
    return class_name(opt) not in RULE


class Refused(Exception):
    """The step cannot be re-executed in float64 as a function of the recorded inputs (the text says why)."""


def _whole(t, what: str, ranks):
    """t as one plain tensor on this rank: a DTensor gathered (its mesh's collective, which every
    rank of the TP group runs in the same hook), a plain tensor as it is. ranks: the TP group's."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        mesh = t.device_mesh
        if mesh.ndim != 1 or (ranks is not None and mesh.size() > 1
                              and sorted(mesh.mesh.reshape(-1).tolist()) != sorted(ranks)):
            # its gather would wait for ranks that run no capture hook (FSDP's data-parallel peers)
            raise Refused(f"{what} is a DTensor on a mesh other than the captured TP group's ({mesh.ndim}-D, "
                          f"ranks {mesh.mesh.reshape(-1).tolist()}): gathering it takes ranks outside it")
        return t.full_tensor().detach()
    return t.detach()


def _sharded(p) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(p, DTensor) and tuple(p.shape) != tuple(p.to_local().shape)


def _state_copy(p, state: dict, name: str, ranks) -> dict:
    out = {}
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            w = _whole(v, f"{name}'s state {k!r}", ranks)
            if w.is_floating_point() and _sharded(p) and type(v) is torch.Tensor and w.numel() > 1 \
                    and tuple(w.shape) != tuple(p.shape):
                # a plain tensor of a sharded parameter: a statistic of this rank's shard (Adafactor's
                # row means of the local rows) or of the whole - which, nothing says
                raise Refused(f"{name}'s state {k!r} is a plain tensor of shape {list(w.shape)} beside a sharded "
                              f"parameter of shape {list(p.shape)}: whether it describes the shard or the whole "
                              "is unknown")
            out[k] = w.to(torch.float64).clone() if w.is_floating_point() else w.clone()
        else:
            try:
                out[k] = copy.deepcopy(v)
            except Exception as e:  # noqa: BLE001 - an object that cannot be copied is shared state
                raise Refused(f"{name}'s state {k!r} ({type(v).__name__}) cannot be copied ({e})") from None
    return out


def _tensors_in(obj, found: list, depth: int = 0) -> list:
    if isinstance(obj, torch.Tensor):
        found.append(obj)
    elif depth < 3 and isinstance(obj, (dict, list, tuple, set)):
        for v in (obj.values() if isinstance(obj, dict) else obj):
            _tensors_in(v, found, depth + 1)
    return found


def shadow_step(opt, args, kwargs, names: dict, ranks=None) -> tuple[dict, list[str]]:
    """({id(real param): its float64 value after the shadow step}, the jumps the step made) for every
    parameter of the captured model in `opt` (names: id -> record names; ranks: the TP group's global
    ranks, None without a process group); Refused says why not."""
    never = _never(opt)
    if never:
        raise Refused(never)
    if tuple(args[1:] if args and args[0] is opt else args) or kwargs:  # torch hands the hook (self, *args)
        raise Refused("step() was called with arguments (a closure re-evaluates the model: the step is not "
                      "a function of the recorded parameters, grads and state)")
    need, cap = shadow_bytes(opt), max_mb()
    if need > cap * 2**20:
        raise Refused(f"its float64 copies (every parameter whole, its grad and state) would take {need / 2**20:,.0f} "
                      f"MiB, over {MAX_MB_ENV}={cap}: raise it where the memory is there, or capture fewer "
                      "parameters")
    real, shadow_of, protected = [], {}, set()
    for t in _tensors_in(opt.__dict__, []):
        protected.add(storage_ptr(getattr(t, "_local_tensor", t)))
    groups = []
    for group in opt.param_groups:
        params = []
        for p in group["params"]:
            if id(p) not in names:
                raise Refused("it also steps parameters outside the captured model (their values are not "
                              "recorded: a step coupling parameters would be re-run without them)")
            name = f"{names[id(p)][0]}.{names[id(p)][1]}"
            w = _whole(p, name, ranks).to(torch.float64).clone()
            if p.grad is not None:
                w.grad = _whole(p.grad, f"{name}'s grad", ranks).to(torch.float64).clone()
            for t in (p, p.grad, *opt.state.get(p, {}).values()):
                if isinstance(t, torch.Tensor):
                    protected.add(storage_ptr(getattr(t, "_local_tensor", t)))
            shadow_of[id(p)] = w
            real.append(p)
            params.append(w)
        groups.append({**{k: copy.copy(v) for k, v in group.items() if k != "params"}, "params": params})
    state = defaultdict(dict)
    for p in real:
        if p in opt.state:
            name = f"{names[id(p)][0]}.{names[id(p)][1]}"
            state[shadow_of[id(p)]] = _state_copy(p, opt.state[p], name, ranks)

    sh = object.__new__(type(opt))
    for k, v in opt.__dict__.items():
        sh.__dict__[k] = copy.copy(v) if isinstance(v, (dict, list, set)) else v
    sh.param_groups, sh.state = groups, state
    sh._optimizer_step_pre_hooks, sh._optimizer_step_post_hooks = OrderedDict(), OrderedDict()
    step = type(opt).step
    if getattr(step, "hooked", False):
        step = step.__wrapped__  # the hooks torch wraps around step() (this capture's own among them)
    mode = _ShadowMode(protected)
    try:
        with _no_process_group(), torch.no_grad(), mode:
            step(sh)
    except (OracleRefused, Refused) as e:
        raise Refused(str(e)) from None
    except Exception as e:  # noqa: BLE001 - the user's code on plain float64 tensors: any failure refuses
        raise Refused(f"its step() on whole float64 tensors raised {type(e).__name__}: {str(e).splitlines()[0][:200]}"
                      if str(e) else f"its step() on whole float64 tensors raised {type(e).__name__}") from None
    got = {}
    for p, w in zip(real, (w for g in sh.param_groups for w in g["params"])):
        if not isinstance(w, torch.Tensor) or w.dtype != torch.float64 or tuple(w.shape) != tuple(p.shape):
            raise Refused("its step() replaced the parameters it holds (param_groups) with tensors of another "
                          "dtype or shape")
        got[id(p)] = w.detach()
    return got, sorted(set(mode.discrete) | mode.jumps)


class _ShadowMode(Float64Mode):
    """Float64Mode, refusing collectives and noting the jumps (JUMPS) the step makes."""

    def __init__(self, protected):
        super().__init__(protected, working=None, known=None)
        self.jumps: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        ns = getattr(func, "namespace", "aten")
        if "c10d" in ns:
            raise OracleRefused(f"its step() talks to other ranks ({ns}::{func.overloadpacket.__name__}): "
                                "re-run on the whole tensors, a collective would count them once per rank")
        if func.overloadpacket.__name__ in JUMPS:
            self.jumps.add(f"{ns}::{func.overloadpacket.__name__}")
        return super().__torch_dispatch__(func, types, args, kwargs)


class _no_process_group:
    """The default process group out of sight while the shadow runs: the step runs as one process."""

    def __enter__(self):
        import torch.distributed as dist

        self.pg = None
        if dist.is_available() and dist.is_initialized():
            from torch.distributed.distributed_c10d import _world

            self.pg, _world.default_pg = _world.default_pg, None
        return self

    def __exit__(self, *exc):
        if self.pg is not None:
            from torch.distributed.distributed_c10d import _world

            _world.default_pg = self.pg
        return False


def agree(refused: str | None, group, device) -> str | None:
    """One decision for the whole TP group: refused on any rank is refused on every rank (each rank
    records the same records: the gather at the end pairs them)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return refused
    flag = torch.tensor([1.0 if refused else 0.0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if flag.item() and not refused:
        return "another rank of the TP group refused its re-execution (its own reason: re-run that rank alone)"
    return refused
