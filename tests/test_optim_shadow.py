"""The float64 re-execution of a user's own optimizer step (probes/optim_shadow.py) on its own:
it computes the step in float64 (a `.bfloat16()` inside it included), leaves the real run's
parameters, grads, state and RNG bit for bit as they were, and refuses - one line why - what is no
function of the recorded inputs: a closure, a random draw, a write to a tensor the optimizer holds, a
collective or a rank asked for, parameters outside the captured model."""
import pytest
import torch

from tpdiag.probes.optim_shadow import Refused, applies, shadow_step


class Plain(torch.optim.Optimizer):
    """SGD with its grad taken through bf16, an integer step count and an optional mistake."""

    def __init__(self, params, lr=0.1, how="ok"):
        super().__init__(params, dict(lr=lr))
        self.how = how
        self.held = torch.zeros(())
        self.group = None  # the TP group a step reduces over, where it holds one

    @torch.no_grad()
    def step(self, closure=None):
        import torch.distributed as dist

        for group in self.param_groups:
            for p in group["params"]:
                st = self.state[p]
                st["n"] = st.get("n", torch.zeros((), dtype=torch.int64)) + 1
                g = p.grad.bfloat16().to(p.dtype)  # Muon-style low-precision arithmetic
                if self.how == "random":
                    g = g + 1e-3 * torch.randn_like(g)
                elif self.how == "writes":
                    self.held.add_(g.sum())
                elif self.how == "all_reduce":
                    dist.all_reduce(g, group=self.group)
                elif self.how == "rank":
                    g = g * (1 + dist.get_rank())
                elif self.how == "guarded" and dist.is_initialized():
                    g = g * dist.get_world_size()
                p.add_(g, alpha=-group["lr"])


def _names(ps):
    return {id(p): ("m", f"p{i}", "m", "Linear") for i, p in enumerate(ps)}


def _stepped(how="ok"):
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))]
    opt = Plain(ps, how=how)
    for p in ps:
        p.grad = torch.randn_like(p) / 3
    return ps, opt


def test_the_step_in_float64_leaves_the_real_run_as_it_was():
    ps, opt = _stepped()
    opt.step()  # a real step first: the shadow starts from its state
    for p in ps:
        p.grad = torch.randn_like(p) / 3
    before = [(p.detach().clone(), p.grad.clone(), opt.state[p]["n"].clone()) for p in ps]
    rng = torch.get_rng_state()
    got, jumps = shadow_step(opt, (opt,), {}, _names(ps))
    assert applies(opt) and not applies(torch.optim.SGD(ps, lr=0.1)) and jumps == []
    for p, (w, g, n) in zip(ps, before):
        assert torch.equal(p.detach(), w) and torch.equal(p.grad, g) and torch.equal(opt.state[p]["n"], n)
        o = got[id(p)]
        # float64, the bf16 cast included: exactly p - lr g in float64, which the bf16 grad is not
        assert o.dtype == torch.float64 and torch.equal(o, w.double() - 0.1 * g.double())
        assert not torch.equal(o, w.double() - 0.1 * g.bfloat16().double())
        assert opt.state[p]["n"].dtype == torch.int64 and int(opt.state[p]["n"]) == 1
    assert torch.equal(torch.get_rng_state(), rng)


@pytest.mark.parametrize("how,args,said", [
    ("ok", (lambda: 0.0,), "closure"),
    ("random", (), "draws random numbers"),
    ("writes", (), "writes state in place"),
])
def test_what_is_no_function_of_the_inputs_is_refused(how, args, said):
    ps, opt = _stepped(how)
    held = opt.held.clone()
    with pytest.raises(Refused, match=said):
        shadow_step(opt, (opt, *args), {}, _names(ps))
    assert torch.equal(opt.held, held)


def test_parameters_outside_the_captured_model_are_refused():
    ps, opt = _stepped()
    with pytest.raises(Refused, match="outside the captured model"):
        shadow_step(opt, (opt,), {}, _names(ps[:1]))


def test_a_step_that_talks_to_other_ranks_is_refused(tmp_path):
    """In a process group (one rank): a collective, or the rank, in step() refuses; a step that asks
    `dist.is_initialized()` runs as one process (no group: the reference's TP=1 semantics)."""
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already up in this worker")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        for how, group, said in (("all_reduce", None, "Default process group"),
                                 ("all_reduce", dist.group.WORLD, r"talks to other ranks \(c10d::allreduce_\)"),
                                 ("rank", None, "Default process group")):
            ps, opt = _stepped(how)
            opt.group = group
            with pytest.raises(Refused, match=said):
                shadow_step(opt, (opt,), {}, _names(ps))
        ps, opt = _stepped("guarded")
        got, _ = shadow_step(opt, (opt,), {}, _names(ps))
        assert torch.equal(got[id(ps[0])], ps[0].detach().double() - 0.1 * ps[0].grad.double())
        assert dist.is_initialized() and dist.get_rank() == 0  # the group is back
    finally:
        dist.destroy_process_group()


def test_a_shadow_over_the_memory_cap_is_refused_before_any_copy(monkeypatch):
    """Real size: every parameter whole in float64 with grad and state would end the user's run out of
    memory; over TPDIAG_OPT_F64_MAX_MB the step is refused, one line saying how much it needed."""
    ps, opt = _stepped()
    opt.step()  # state "n" is an integer: not counted
    for p in ps:
        p.grad = torch.randn_like(p) / 3
    monkeypatch.setenv("TPDIAG_OPT_F64_MAX_MB", "0")
    with pytest.raises(Refused, match="TPDIAG_OPT_F64_MAX_MB=0"):
        shadow_step(opt, (opt,), {}, _names(ps))
    monkeypatch.setenv("TPDIAG_OPT_F64_MAX_MB", "1")  # 15 elements x 8 B x (param, grad): far under 1 MiB
    got, _ = shadow_step(opt, (opt,), {}, _names(ps))
    assert set(got) == {id(p) for p in ps}


# torch's own optimizers without an update rule in tpdiag: elementwise, so their float64 step on
# float64 copies is the same function the shadow computes (Muon's `.bfloat16()` is not: the shadow
# runs it in float64 - tests/test_own_optim.py covers it in a TP world)
_TORCH_OWN = [getattr(torch.optim, n) for n in ("RMSprop", "Adagrad", "Adafactor", "Rprop", "NAdam", "RAdam",
                                                "Adamax", "ASGD", "Adadelta") if hasattr(torch.optim, n)]


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("cls", _TORCH_OWN, ids=lambda c: c.__name__)
def test_torchs_own_optimizer_is_its_float64_step(cls, foreach):
    """The capture re-executes it (applies), and the shadow's result is bit for bit the same class
    stepping float64 copies from the same state - the for-loop and the foreach (GPU default) kernels."""
    import copy

    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))]
    opt = cls(ps, foreach=foreach)
    assert applies(opt)
    for p in ps:
        p.grad = torch.randn_like(p) / 3
    opt.step()  # a real step first: the shadow starts from its state
    for p in ps:
        p.grad = torch.randn_like(p) / 3
    before = [(p.detach().clone(), copy.deepcopy(opt.state[p])) for p in ps]
    qs = [torch.nn.Parameter(p.detach().double()) for p in ps]
    twin = cls(qs, foreach=foreach)
    twin.load_state_dict(copy.deepcopy(opt.state_dict()))  # its floating state cast to float64
    for p, q in zip(ps, qs):
        q.grad = p.grad.double()
    got, _ = shadow_step(opt, (opt,), {}, _names(ps))
    twin.step()
    for p, q, (w, st) in zip(ps, qs, before):
        assert torch.equal(got[id(p)], q.detach()), cls
        assert torch.equal(p.detach(), w) and all(torch.equal(v, st[k]) for k, v in opt.state[p].items()
                                                  if isinstance(v, torch.Tensor))


def test_torchs_optimizers_no_step_can_be_had_of_are_refused_with_why():
    """LBFGS steps through its closure: refused, the reason naming it (a generic TypeError before).
    SparseAdam, refused until its sparse grads were recorded, is re-run: tests/test_sparse_grads.py."""
    lin = torch.nn.Linear(3, 2)
    lin(torch.randn(4, 3)).sum().backward()
    ps = list(lin.parameters())
    with pytest.raises(Refused, match="LBFGS steps through its closure"):
        opt = torch.optim.LBFGS(ps)
        shadow_step(opt, (opt,), {}, _names(ps))


class _MyLBFGS(torch.optim.LBFGS):
    pass


def test_a_subclass_of_a_refused_optimizer_is_refused():
    """NEVER is looked up along the class's MRO: a user's subclass of LBFGS steps through the same
    closure (review hreview25: on 3ab68ae1 the lookup was by the exact class name)."""
    ps = [torch.nn.Parameter(torch.randn(4))]
    ps[0].grad = torch.randn(4)
    opt = _MyLBFGS(ps)
    assert applies(opt)
    with pytest.raises(Refused, match="LBFGS steps through its closure"):
        shadow_step(opt, (opt,), {}, _names(ps))
