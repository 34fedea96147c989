"""Models as users write them (tests/models/user_style.py): a `forward(self, tokens)`, a plain
`ColwiseParallel()` head (unmarked local vocab shards), a head reading a slice of the final
norm's output; a user's exception named at its file:line; plans refused before launch."""
import csv
import json
import os
import re

import pytest
import torch
from torch import nn

from conftest import ROOT, run_cli

MODEL = os.path.join("tests", "models", "user_style.py")


def _compare(tmp_path_factory, func, *extra, tp="1,2"):
    out = tmp_path_factory.mktemp(func) / "run"
    p = run_cli("compare", "--model", f"py:{MODEL}:{func}", "--tp", tp, "--out", str(out),
                "--no-confirm", "--no-baseline", "--format", "json", *extra)
    return p, out


def _rows(out, label="2"):
    with open(out / "diff.csv") as f:
        return {r["key"]: r for r in csv.DictReader(f) if r["degree"] == label}


@pytest.fixture(scope="module")
def local_and_marked(tmp_path_factory):
    runs = {}
    for func in ("target", "target_marked"):
        p, out = _compare(tmp_path_factory, func)
        assert p.returncode == 0, p.stderr + p.stdout
        runs[func] = (json.loads(p.stdout), _rows(out))
    return runs


def test_local_vocab_shards_give_the_marked_heads_verdict(local_and_marked):
    # forward(self, tokens) ran at TP=1 and TP=2; the plain ColwiseParallel head's local
    # shards went through tpdiag's logprobs/loss without an IndexError
    (s_loc, rows_loc), (s_mark, rows_mark) = local_and_marked["target"], local_and_marked["target_marked"]
    assert s_loc["status"] == s_mark["status"] == "divergent"
    d_loc, d_mark = s_loc["degrees"]["2"], s_mark["degrees"]["2"]
    keys = ("phase", "module", "kind", "name", "cause", "max_abs", "bound")
    assert {k: d_loc["first_divergence"][k] for k in keys} == {k: d_mark["first_divergence"][k] for k in keys}
    assert d_loc["first_divergence"]["cause"] == "row-parallel-reduction"
    assert d_loc["findings"] == d_mark["findings"] == []
    assert d_loc["logprobs"] == d_mark["logprobs"] and d_loc["loss"] == d_mark["loss"]
    # every record, the head's output and the logits included, compares the same way
    assert set(rows_loc) == set(rows_mark)
    for k in rows_loc:
        assert (rows_loc[k]["bitwise"], rows_loc[k]["layout"]) == \
            (rows_mark[k]["bitwise"], rows_mark[k]["layout"]), k
    assert rows_loc["s0/loss/model/logits#0/logits"]["layout"] == "shard:2"


def test_user_loss_still_receives_local_shards(tmp_path_factory):
    # the loss asserts a plain tensor of VOCAB / TP columns; a whole or DTensor input fails it
    p, _ = _compare(tmp_path_factory, "target_local_loss")
    assert p.returncode == 0, p.stderr + p.stdout
    s = json.loads(p.stdout)
    assert s["degrees"]["2"].get("error") is None and s["status"] != "inconclusive", s


def test_head_dgrad_through_a_slice_is_column_parallel_dgrad(tmp_path_factory):
    # only the head is split and its logits gathered: forward and loss are bitwise equal, the
    # first difference is the head's dgrad into the final norm - which the head read as a view
    p, out = _compare(tmp_path_factory, "target_head_only")
    assert p.returncode == 0, p.stderr + p.stdout
    fd = json.loads(p.stdout)["degrees"]["2"]["first_divergence"]
    assert (fd["phase"], fd["module"], fd["kind"]) == ("backward", "norm", "grad_out"), fd
    assert fd["cause"] == "column-parallel-dgrad", fd
    events = [json.loads(x) for x in open(out / "tp2" / "events.jsonl")]
    norm = next(e for e in events if e["key"] == "s0/backward/norm/grad_out#0/0")
    assert norm["consumers"] == ["head"]


def test_user_exception_names_its_file_and_line(tmp_path_factory):
    p, out = _compare(tmp_path_factory, "target_bad_loss", "--debug")
    assert p.returncode == 2, p.stderr + p.stdout
    err = json.loads(p.stdout)["degrees"]["2"]["error"]
    line = next(i for i, x in enumerate(open(os.path.join(ROOT, MODEL)), 1) if "F.cross_entropy" in x)
    assert re.match(rf"rank [01]: IndexError at {re.escape(MODEL)}:{line} in bad_loss: Target \d+ is "
                    "out of bounds", err), err
    # --debug: the rank's own traceback, down to the user's line
    assert "--- TP=2 rank" in p.stderr and f'{MODEL}", line {line}, in bad_loss' in p.stderr, p.stderr


@pytest.mark.parametrize("spec,tp,needle", [
    (f"py:{MODEL}:target_bad_plan", "1,2", "plan entry 'blocks.*.fc1' matches no module"),
    (f"py:{MODEL}:target", "1,3", "--tp 3: does not divide embed vocab=128"),
    ("hf:{stablelm}", "1,2", "stablelm has no tensor-parallel plan"),
])
def test_refused_before_any_world_starts(tmp_path, spec, tp, needle):
    if spec.startswith("hf:"):
        pytest.importorskip("transformers", minversion="5")
        kind = spec[4:-1]
        d = tmp_path / kind
        d.mkdir()
        cfg = {"model_type": kind, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 4,
               "intermediate_size": 128, "num_hidden_layers": 1, "vocab_size": 128}
        (d / "config.json").write_text(json.dumps(cfg))
        spec = f"hf:{d}"
    out = tmp_path / "run"
    p = run_cli("compare", "--model", spec, "--tp", tp, "--out", str(out), "--no-confirm")
    assert p.returncode == 2, p.stderr + p.stdout
    assert needle in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert not out.exists()  # nothing launched, nothing written


class _Tokens(nn.Module):
    def forward(self, tokens):
        return tokens


class _KwOnly(nn.Module):
    def forward(self, *, ids, extra=None):
        return ids


def test_forward_call_binds_the_first_parameter():
    from tpdiag.errors import BadInput
    from tpdiag.runner.batch import forward_call

    t = torch.zeros(1, 2, dtype=torch.long)
    assert forward_call(_Tokens(), t) == ((t,), {})
    args, kw = forward_call(_KwOnly(), t)
    assert args == () and kw["ids"] is t
    assert forward_call(_Tokens(), (t, t)) == ((t, t), {})
    assert forward_call(_Tokens(), {"tokens": t}) == ((), {"tokens": t})

    class NoArg(nn.Module):
        def forward(self):
            return 0

    with pytest.raises(BadInput, match="takes no argument"):
        forward_call(NoArg(), t)
