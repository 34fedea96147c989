"""`tpdiag compare --model hf:DIR` on a checkpoint saved in bf16, run without --dtype (float32, the
default): before, it ran float32 without a word while the user's `from_pretrained(DIR)` loads bf16.
Now a note line (after the verdict, which stays the first line) and `checkpoint_dtype` in the json."""
import json

import pytest
from conftest import run_cli

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    import torch
    from hf_configs import save_tiny_bf16_llama
    from transformers import LlamaForCausalLM

    d = save_tiny_bf16_llama(tmp_path_factory.mktemp("ckpt") / "model")
    # what the user's own code loads it as, without a dtype: the note must say the same
    assert LlamaForCausalLM.from_pretrained(str(d)).model.embed_tokens.weight.dtype == torch.bfloat16
    return str(d)


def _compare(ckpt, tmp_path, *extra):
    p = run_cli("compare", "--model", "hf:" + ckpt, "--tp", "1,1", "--no-confirm", "--forward-only",
                "--batch-size", "2", "--seq-len", "8", "--out", str(tmp_path / "r"), "--format", "json", *extra)
    assert p.returncode == 0, p.stderr + p.stdout
    return json.loads(p.stdout)


def test_bf16_checkpoint_run_in_float32_is_named(ckpt, tmp_path):
    from tpdiag.cli.render import render_text

    s = _compare(ckpt, tmp_path)
    assert s["checkpoint_dtype"]["saved"] == "bfloat16" and s["checkpoint_dtype"]["ran"] == "float32"
    note = s["checkpoint_dtype"]["note"]
    assert "saved in bfloat16" in note and "`from_pretrained(DIR)` loads it in bfloat16" in note
    assert "add --dtype bfloat16" in note
    lines = render_text(s).splitlines()
    assert lines[0].startswith("verdict: ")  # the output contract: the verdict first
    assert f"note: {note}" in lines
    on_disk = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert on_disk["checkpoint_dtype"] == s["checkpoint_dtype"]


def test_matching_dtype_says_nothing(ckpt, tmp_path):
    from tpdiag.cli.render import render_text

    s = _compare(ckpt, tmp_path, "--dtype", "bfloat16")  # control: the dtype it is saved in
    assert s["checkpoint_dtype"] == {"saved": "bfloat16", "ran": "bfloat16", "note": None}
    assert not any(line.startswith("note: the checkpoint") for line in render_text(s).splitlines())
