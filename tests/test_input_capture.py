"""tpdiag.capture(plan=...) with a misspelt style name ('colwsie') is refused in one line naming
the word it misspells (api/capture_layouts.py): it was dropped without a word, leaving the module
unlabelled. transformers' own style names (model.tp_plan) still pass. In-process, no world."""
import pytest
import torch

import tpdiag
from tpdiag.errors import BadInput


def _model():
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 4))


@pytest.mark.parametrize("word,meant", [("colwsie", "colwise"), ("row-wise", "rowwise"),
                                        ("colwise_gather_outptu", "colwise_gather_output")])
def test_a_misspelt_style_is_refused(tmp_path, word, meant):
    with pytest.raises(BadInput, match=rf"^capture\(plan=\{{'0': '{word}'\}}\): unknown style name; "
                                       rf"did you mean '{meant}'\?"):
        tpdiag.capture(_model(), out=str(tmp_path / "cap"), plan={"0": word, "1": "rowwise"})
    assert not (tmp_path / "cap").exists()


@pytest.mark.parametrize("word", ["colwise", "packed_rowwise", "local_packed_rowwise", "moe_tp_experts",
                                  "replicated_with_grad_allreduce", "grouped_gemm", "my_own_style"])
def test_known_and_unrelated_words_pass(tmp_path, word):
    tpdiag.capture(_model(), out=str(tmp_path / "cap"), plan={"0": word})
