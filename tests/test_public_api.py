"""The public switch (`tpdiag.invariant` and friends) in a user's own training loop.

tests/user_tp_train.py is written as a user writes a TP training script (plain torch, its own
model and DTensor plan, its own AdamW loop); run under torchrun at TP=1 and TP=2 it must give
bitwise equal losses, grad norms and parameters with the switch on, and must not without it.
"""
import ast
import os
import re
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from conftest import ROOT, run_module

SCRIPT = os.path.join(ROOT, "tests", "user_tp_train.py")


def torchrun(nproc: int, out, *args) -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    p = run_module("torch.distributed.run", "--standalone",
                   "--nproc-per-node", str(nproc), SCRIPT, "--out", str(out), *args, env=env, cwd=ROOT, timeout=300)
    # torch 2.13 + gloo can abort a rank at interpreter teardown after its work is done; the
    # file (written by rank 0 after every collective) is the evidence
    assert out.is_file(), p.stdout[-3000:] + p.stderr[-3000:]
    return load_file(str(out))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{(run, TP): {name: tensor}}: one launch per degree, the stock run first in each."""
    base = tmp_path_factory.mktemp("public_api")
    out = {}
    for n in (1, 2):
        got = torchrun(n, base / f"tp{n}.safetensors", "--runs", "stock,invariant")
        for run in ("stock", "invariant"):
            out[run, n] = {k.split("/", 1)[1]: v for k, v in got.items() if k.startswith(run + "/")}
    return out


def test_user_loop_is_bitwise_across_tp_with_the_switch(runs):
    a, b = runs["invariant", 1], runs["invariant", 2]
    assert sorted(a) == sorted(b) and "loss" in a and any(k.startswith("param.") for k in a)
    assert a["loss"].numel() == 4 and bool(torch.isfinite(a["loss"]).all())
    assert bool((a["loss"][1:] < a["loss"][:1]).all())  # it trained
    for k in a:
        assert torch.equal(a[k], b[k]), (k, (a[k].double() - b[k].double()).abs().max())


def test_negative_control_differs_without_the_switch(runs):
    a, b = runs["stock", 1], runs["stock", 2]
    assert sorted(a) == sorted(b) == sorted(runs["invariant", 1])
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    # the row-parallel `down` (K=512 split in two) and the vocab-parallel loss reorder sums
    assert "loss" in differ and "param.down.weight" in differ, differ
    # the same init and batch: the switch changes the bits at TP=1 too (tree-ordered sums)
    assert torch.allclose(a["loss"][0], runs["invariant", 1]["loss"][0], rtol=1e-5)
    assert not torch.equal(a["param.down.weight"], runs["invariant", 1]["param.down.weight"])
    assert torch.allclose(a["param.down.weight"], runs["invariant", 1]["param.down.weight"], atol=1e-3)


def test_import_is_cheap_and_every_public_name_resolves():
    code = "import sys, tpdiag; assert 'torch' not in sys.modules, 'torch imported'; print('ok')"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=ROOT))
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr
    import tpdiag

    for name in tpdiag.__all__:
        assert getattr(tpdiag, name) is getattr(tpdiag, name), name  # not shadowed by a module
    assert callable(tpdiag.invariant) and callable(tpdiag.deterministic)
    assert issubclass(tpdiag.BadInput, tpdiag.TpdiagError)


def _tiny():
    from torch import nn
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("up", nn.Linear(8, 32))
    model.add_module("down", nn.Linear(32, 16))
    return model, {"up": ColwiseParallel(), "down": RowwiseParallel()}


@pytest.mark.parametrize("kwargs,needle", [
    (dict(fixes="tp-invariant-linaer", tree_groups=2), "unknown fix 'tp-invariant-linaer'"),
    (dict(fixes=["invariant-gemm", "invariant-gemm"], tree_groups=2), "named twice"),
    (dict(fixes="all", tree_groups=3), "tree_groups=3: must be a power of two"),
    (dict(fixes="all", tree_groups=0), "tree_groups=0: must be a power of two"),
    (dict(fixes="all"), "tree_groups: required"),
    (dict(fixes="all", tree_groups=2, group_gemm="tiled"), "group_gemm='tiled'"),
    (dict(fixes="all", tree_groups=64), "reduced dimension 32 is not divisible by 64"),
])
def test_bad_input_is_a_typed_error_and_installs_nothing(kwargs, needle, monkeypatch):
    import tpdiag

    monkeypatch.delenv("TPDIAG_TREE_GROUPS", raising=False)
    model, plan = _tiny()
    before = torch.are_deterministic_algorithms_enabled()
    with pytest.raises(tpdiag.BadInput, match=re.escape(needle)):
        with tpdiag.invariant(model, plan, **kwargs):
            pass
    assert "forward" not in model.up.__dict__ and "forward" not in model.down.__dict__
    assert torch.are_deterministic_algorithms_enabled() == before


def test_bad_plan_is_refused():
    import tpdiag

    model, plan = _tiny()
    with pytest.raises(tpdiag.BadInput, match=r"plan\['mlp.up'\]: matches no module"):
        with tpdiag.invariant(model, {**plan, "mlp.up": plan["up"]}, tree_groups=2):
            pass
    with pytest.raises(tpdiag.BadInput, match="expected a ParallelStyle object or one of colwise"):
        with tpdiag.invariant(model, {"up": "colwise_gather_output"}, tree_groups=2):
            pass


def test_tree_groups_must_be_divided_by_the_tp_degree():
    from tpdiag.errors import BadInput
    from tpdiag.api.invariant import check_groups, fix_names

    assert check_groups(8, 2, fix_names()) == 8
    assert check_groups(None, 2, ("invariant-attention",)) == 0  # no grouped fix: no G needed
    with pytest.raises(BadInput, match="TP=4 does not divide it"):
        check_groups(2, 4, fix_names())
    with pytest.raises(BadInput, match="power-of-two TP degree"):
        check_groups(8, 3, ("tp-invariant-linear",))


def test_everything_is_restored_even_when_the_block_raises():
    import torch.nn.functional as F

    import tpdiag
    from tpdiag.fixes import state

    model, plan = _tiny()
    x = torch.randn(4, 8)
    logits, labels = torch.randn(6, 16), torch.tensor([1, 2, 3, -100, 5, 15])
    stock = F.cross_entropy(logits, labels)
    saved = (torch.are_deterministic_algorithms_enabled(), torch.get_float32_matmul_precision(),
             torch.backends.cudnn.benchmark, os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
             torch.get_num_threads())
    with pytest.raises(RuntimeError, match="user error"):
        with tpdiag.invariant(model, plan, tree_groups=2):
            assert torch.are_deterministic_algorithms_enabled()
            assert "forward" in model.up.__dict__  # the invariant linear is installed
            assert state.active("invariant-grad-norm")
            inside = F.cross_entropy(logits, labels)  # caught by invariant-vocab-softmax
            none = F.cross_entropy(logits, labels, reduction="none")
            raise RuntimeError("user error")
    # the invariant loss is a loss (close to torch's), and a different sum order
    assert torch.allclose(inside, stock, rtol=1e-6) and none[3] == 0
    assert torch.allclose(none.sum() / 5, stock, rtol=1e-6)
    assert saved == (torch.are_deterministic_algorithms_enabled(), torch.get_float32_matmul_precision(),
                     torch.backends.cudnn.benchmark, os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
                     torch.get_num_threads())
    assert "forward" not in model.up.__dict__ and not state.active("invariant-grad-norm")
    assert torch.equal(F.cross_entropy(logits, labels), stock)
    y = model(x)  # the stock forward again
    assert torch.equal(y, model.down(model.up(x)))


def test_clip_grad_norm_outside_the_switch_is_the_plain_global_norm():
    import tpdiag

    model, _ = _tiny()
    model(torch.randn(4, 8)).square().sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    want = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    total = tpdiag.clip_grad_norm_(model.parameters(), None)
    assert torch.equal(total, want)
    tpdiag.clip_grad_norm_(model.parameters(), float(want) / 2)
    assert all(torch.allclose(p.grad, g / 2, rtol=1e-5) for p, g in zip(model.parameters(), grads))
    with pytest.raises(tpdiag.BadInput, match="max_norm"):
        tpdiag.clip_grad_norm_(model.parameters(), -1.0)


def _internal_imports(text: str) -> list[str]:
    """`tpdiag.X` modules a Python source imports where X is not a public name."""
    import tpdiag

    found = []
    for node in ast.walk(ast.parse(text)):
        mods = []
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tpdiag"):
            mods = [node.module] if node.module != "tpdiag" else []
            found += [f"tpdiag.{a.name}" for a in node.names
                      if node.module == "tpdiag" and a.name not in tpdiag.__all__]
        elif isinstance(node, ast.Import):
            mods = [a.name for a in node.names if a.name.startswith("tpdiag.")]
        found += mods
    return found


def test_no_doc_or_example_imports_an_internal_module():
    """README, docs/ and examples/ use only tpdiag's public names (examples/readme_output.py is
    the maintainers' README generator, which renders with the CLI's own renderer)."""
    bad = {}
    for name in sorted(os.listdir(os.path.join(ROOT, "examples"))):
        if name.endswith(".py") and name != "readme_output.py":
            with open(os.path.join(ROOT, "examples", name)) as f:
                hits = _internal_imports(f.read())
            if hits:
                bad[f"examples/{name}"] = hits
    docs = [os.path.join(ROOT, "README.md")] + [os.path.join(ROOT, "docs", n)
                                                 for n in sorted(os.listdir(os.path.join(ROOT, "docs")))
                                                 if n.endswith(".md")]
    for path in docs:
        with open(path) as f:
            text = f.read()
        hits = re.findall(r"^\s*(?:from\s+(tpdiag\.[\w.]+)\s+import|import\s+(tpdiag\.[\w.]+))", text, re.M)
        hits = [a or b for a, b in hits]
        if hits:
            bad[os.path.relpath(path, ROOT)] = hits
    assert not bad, bad


TORCHTITAN_SCRIPT = os.path.join(ROOT, "tests", "user_torchtitan_step.py")


def test_torchtitan_llama3_under_the_switch_is_bitwise_across_tp(tmp_path):
    """torchtitan's own Llama3, sharded by torchtitan, one step under tpdiag.invariant at TP=1
    and TP=2 (forward + loss on the CPU: flex attention has no CPU backward; + backward and an
    AdamW step on GPUs); stock, the loss differs (tests/test_torchtitan.py: a row-parallel
    all-reduce). Four launches of a heavy model: only where torchtitan is installed."""
    pytest.importorskip("torchtitan.models.llama3")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    extra = ["--backward"] if torch.cuda.is_available() else []
    got = {}
    for mode in ("invariant", "stock"):
        for n in (1, 2):
            out = tmp_path / f"{mode}{n}.safetensors"
            p = run_module("torch.distributed.run", "--standalone",
                           "--nproc-per-node", str(n), TORCHTITAN_SCRIPT, "--out", str(out), *extra,
                           *(["--stock"] if mode == "stock" else []), env=env, cwd=ROOT, timeout=900)
            assert out.is_file(), p.stdout[-3000:] + p.stderr[-3000:]
            got[mode, n] = load_file(str(out))
    a, b = got["invariant", 1], got["invariant", 2]
    assert sorted(a) == sorted(b) and a["logits"].shape[-1] == 2048
    for k in a:
        assert torch.equal(a[k], b[k]), (k, (a[k].double() - b[k].double()).abs().max())
    assert not torch.equal(got["stock", 1]["logits"], got["stock", 2]["logits"])
