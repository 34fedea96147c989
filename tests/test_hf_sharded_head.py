"""`--variant sharded-head` on an hf: model (tiny qwen3_moe, real gloo worlds at TP=1,2): the LM
head runs as transformers' "colwise" - each rank keeps its vocab shard of the logits instead of
the gathered whole vocab of the stock plan - and the loss and logprobs run vocab-parallel. With
--fix all every record is bitwise (invariant-vocab-softmax on the shards); the stock run of the
same variant is the negative control (divergent)."""
import csv
import json

import pytest

from conftest import run_cli
from hf_configs import write_tiny

pytest.importorskip("transformers", minversion="5")


def _compare(out, spec, *args):
    p = run_cli("compare", "--model", spec, "--tp", "1,2", "--variant", "sharded-head", "--out", str(out),
                "--format", "json", "--no-baseline", "--no-confirm", *args)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads((out / "summary.json").read_text()), list(csv.DictReader(open(out / "diff.csv")))


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    return write_tiny("qwen3_moe", tmp_path_factory.mktemp("shead") / "qwen3_moe")


def _head_rows(rows):
    return {(r["phase"], r["module"], r["kind"]): r for r in rows if r["degree"] == "2"
            and (r["module"] == "lm_head" or r["kind"] in ("logits", "logprobs", "loss"))}


def test_fix_all_bitwise_with_vocab_shard_logits(spec, tmp_path):
    s, rows = _compare(tmp_path / "fix", spec, "--fix", "all")
    assert s["status"] == "bitwise", json.dumps(s["degrees"])[:1500]
    d = s["degrees"]["2"]
    assert d["status"] == "bitwise" and d["logprobs"]["bitwise"]
    mine = [r for r in rows if r["degree"] == "2"]
    assert {"forward", "backward", "optimizer"} <= {r["phase"] for r in mine}
    assert all(r["bitwise"] == "True" for r in mine)
    head = _head_rows(rows)
    # the head's output and the logits were each rank's vocab shard (gathered by tpdiag for the
    # comparison only), not the whole vocab on every rank as the stock plan's colwise_gather_output
    assert head[("forward", "lm_head", "out")]["layout"].startswith("shard")
    assert head[("loss", "model", "logits")]["layout"].startswith("shard")
    assert head[("backward", "lm_head", "grad_out")]["layout"].startswith("shard")


def test_stock_diverges(spec, tmp_path):
    # negative control: the same variant without the fixes (forward only: the control is the
    # forward's row-parallel reductions and the vocab-parallel log-softmax's sums, in pass 1's
    # records: no own-input judgement past the first divergence)
    s, rows = _compare(tmp_path / "stock", spec, "--forward-only", "--no-judge-downstream")
    assert s["status"] == "divergent"
    assert _head_rows(rows)[("loss", "model", "logits")]["layout"].startswith("shard")


def test_plan_and_bad_variant(spec, tmp_path):
    import torch  # noqa: F401

    from tpdiag.errors import BadInput
    from tpdiag.models.hf import meta_hf_target

    stock = meta_hf_target(spec[3:])[0].plan
    sharded = meta_hf_target(spec[3:], "sharded-head")[0].plan
    assert stock["lm_head"].hf_name == "colwise_gather_output"
    assert sharded["lm_head"].hf_name == "colwise"
    # every other entry as transformers has it
    assert {k: v.hf_name for k, v in stock.items() if k != "lm_head"} == \
        {k: v.hf_name for k, v in sharded.items() if k != "lm_head"}
    with pytest.raises(BadInput, match="sharded-head"):
        meta_hf_target(spec[3:], "stable")
    p = run_cli("compare", "--model", spec, "--tp", "1,2", "--variant", "stable", "--out", str(tmp_path / "x"))
    assert p.returncode == 2 and "--variant 'stable'" in p.stderr and "sharded-head" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
