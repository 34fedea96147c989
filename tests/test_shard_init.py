"""Sharded init (issue #20 item 3): at TP > 1 the built-in presets and hf: models are sharded on
the meta device and materialised module by module, so no rank holds the whole model. One real
2-rank gloo world builds every case both ways - the sharded path, and the whole-model path
(build, cast, then shard: what main did, forced here) - and checks on BOTH ranks that every
local shard is bitwise the same, that one training step (logits, loss, grads, AdamW update) is
bitwise the same, and that the sharded path never held more full (unsharded) bytes at once than
the largest module's own tensors, where the whole path (the negative control) held the whole
model. The cross-degree check (each rank's shard == the same slice of TP=1's weights) is
tests/test_meta_init.py's, through real compares."""
import functools
import os

import pytest
import torch

from conftest import gloo_world
from hf_configs import write_tiny

# (name, model spec kind, variant, dtype)
CASES = [("builtin", "builtin", "stock", "float32"), ("builtin-sp", "builtin", "sp", "float32"),
         ("builtin-bf16", "builtin", "stock", "bfloat16"), ("hf-llama", "hf", "stock", "float32"),
         ("hf-qwen3-st-tied", "hf_st", "stock", "bfloat16"),
         # the LM head as a vocab shard (transformers' colwise), still tied to the embedding
         ("hf-qwen3-st-tied-sharded-head", "hf_st", "sharded-head", "bfloat16")]


def _bits(t):
    t = t.detach().contiguous()
    views = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float64: torch.int64}
    return t.view(views[t.dtype]) if t.dtype in views else t


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _tensors(model) -> dict:
    out = dict(model.named_parameters(remove_duplicate=False))
    out.update(model.named_buffers(remove_duplicate=False))
    return out


def _largest_module_bytes(model) -> int:
    """The largest module's own parameters and buffers, whole (global shapes), in float32."""
    best = 0
    for mod in model.modules():
        own = {id(t): t for t in list(mod.parameters(recurse=False)) + list(mod.buffers(recurse=False))}
        best = max(best, sum(t.numel() * 4 for t in own.values()))
    return best


def _step(cfg, target, model, world):
    """One forward/loss/backward/AdamW step as the runner does it (no probes): what it produced."""
    from tpdiag.runner.batch import forward_call, make_batch
    from tpdiag.runner.logits import logits_of, whole_vocab
    from tpdiag.runner.losses import default_loss, loss_context

    batch, labels = make_batch(cfg, target, torch.device("cpu"))
    args, kwargs = forward_call(model, batch)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, foreach=False)
    local_logits = logits_of(model(*args, **kwargs))
    logits, _ = whole_vocab(local_logits, model, target.plan, target.vocab_size, world)
    with loss_context(world):
        loss = default_loss(logits, labels)
        loss.backward()
    out = {"logits": _local(logits).detach().clone(), "loss": _local(loss).detach().clone()}
    out.update({f"grad:{n}": _local(p.grad).clone() for n, p in model.named_parameters()})
    opt.step()
    out.update({f"param:{n}": _local(p).detach().clone() for n, p in model.named_parameters()})
    return out


def _worker(specs, rank, world, port, q):
    import torch.distributed as dist

    from tpdiag.config import WorldConfig
    from tpdiag.models import build
    from tpdiag.models.shard_init import ShardedInitUnsupported
    from tpdiag.runner.build import build_model

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    sharded_build = build.build_sharded

    def forced_whole(*a, **k):
        raise ShardedInitUnsupported("forced by the test: the whole-model path")

    results = {}
    for name, kind, variant, dtype in CASES:
        cfg = WorldConfig.of(model=specs[kind], degree=world, label=str(world), out_dir="",
                             dtype=dtype, variant=variant, batch_size=2, seq_len=8)
        built = {}
        for path in ("sharded", "whole"):
            build.build_sharded = sharded_build if path == "sharded" else forced_whole
            target, model = build_model(cfg, torch.device("cpu"), world)
            tensors = {k: _bits(_local(v)).clone() for k, v in _tensors(model).items()}
            ties = len({id(v) for v in _tensors(model).values()})  # a tied pair is one object
            built[path] = (target.build, tensors, _step(cfg, target, model, world),
                           _largest_module_bytes(model), ties)
        (info_s, ts, ss, largest, ties_s), (info_w, tw, sw, _, ties_w) = built["sharded"], built["whole"]
        results[name] = {
            "init": (info_s["init"], info_w["init"]), "reason": info_w.get("init_reason"),
            "peak": info_s["init_full_peak_bytes"], "whole_peak": info_w["init_full_peak_bytes"],
            "whole_bytes": info_s["init_whole_bytes"], "largest": largest,
            "keys_equal": ts.keys() == tw.keys() and ss.keys() == sw.keys(),
            "n": len(ts), "ties": (ties_s, ties_w),
            "mismatch": [k for k in ts if k in tw and not torch.equal(ts[k], tw[k])],
            "step_mismatch": [k for k in ss if k in sw and not torch.equal(_bits(ss[k]), _bits(sw[k]))],
            "sharded_locals": sum(1 for k, v in _tensors(model).items() if hasattr(v, "to_local")),
        }
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    if rank == 0:
        q.put(gathered)


@pytest.fixture(scope="module")
def world_results(tmp_path_factory):
    from test_meta_init import _st_dir

    base = tmp_path_factory.mktemp("shardinit")
    write_tiny("llama", base / "llama", num_hidden_layers=1)
    specs = {"builtin": "tiny-llama", "hf": f"hf:{base / 'llama'}",
             "hf_st": f"hf:{_st_dir(base / 'qwen3_st')}"}
    return gloo_world(functools.partial(_worker, specs), 2, timeout=300)


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_sharded_init_bitwise_and_bounded(world_results, case):
    for rank, results in enumerate(world_results):
        r = results[case]
        assert r["init"] == ("sharded", "whole"), (rank, r["init"], r["reason"])
        assert r["keys_equal"] and r["n"] > 0 and r["sharded_locals"] > 0, (rank, r)
        assert r["ties"][0] == r["ties"][1] and (r["ties"][0] < r["n"]) == ("tied" in case), r["ties"]
        assert r["mismatch"] == [], (rank, r["mismatch"])           # every local shard, bitwise
        assert r["step_mismatch"] == [], (rank, r["step_mismatch"])  # one step, bitwise
        # at most one module's full tensors at a time (a tied pair is one tensor, one unit)...
        assert 0 < r["peak"] <= r["largest"], (rank, r["peak"], r["largest"])
        # ...where the whole path held all of them: the negative control of the same measure
        assert r["whole_peak"] == r["whole_bytes"] and r["whole_peak"] >= 3 * r["peak"], (rank, r)


def test_rule_writing_another_module_falls_back():
    """A rule that writes a tensor of another module cannot be run shard by shard: detected (the
    version counters), never silently different weights."""
    from torch import nn

    from tpdiag.models.shard_init import ShardedInitUnsupported, materialize_sharded

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))

    def rule(fqn, module):
        if isinstance(module, nn.Linear):
            module.reset_parameters()
        if fqn == "":  # the parent also rewrites its first child's weight
            model[0].weight.mul_(2)

    with pytest.raises(ShardedInitUnsupported, match=r"^0\.weight was written after"):
        materialize_sharded(model, "cpu", 1, rule, torch.float32)
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))

    def early(fqn, module):
        if isinstance(module, nn.Linear):
            module.reset_parameters()
        if fqn == "0":  # a child writes its sibling's (still meta) weight
            model[1].weight.zero_()

    with pytest.raises(ShardedInitUnsupported, match=r"^1\.weight was written before"):
        materialize_sharded(model, "cpu", 1, early, torch.float32)


def test_unfilled_tensor_named():
    from torch import nn

    from tpdiag.errors import BadInput
    from tpdiag.models.shard_init import materialize_sharded

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    with pytest.raises(BadInput, match=r"^0\.bias: not initialised"):
        materialize_sharded(model, "cpu", 1, lambda f, m: m.weight.normal_() if f else None,
                            torch.float32)
