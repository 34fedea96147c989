"""A user's own TP plan for a StableLM checkpoint (qk_layernorm: one LayerNorm per head, a
ModuleList) loaded with plain `from_pretrained`. transformers has no TP plan for stablelm, so the
user writes one: q/k/v column-parallel, o_proj row-parallel, and the attention's head counts made
the rank's own (its forward views q with `self.num_heads`). The per-head norms are zipped with the
local heads in order, so each rank must keep its own heads' norms (`norms_cut`, correct); left
whole (`heads_only`), rank 1 normalises heads 2, 3 with heads 0, 1's norms - a real bug."""
import os

from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel
from transformers import AutoModelForCausalLM

import tpdiag

DIR = os.environ["USER_STABLELM_DIR"]   # the checkpoint the test saved (save_pretrained)
A, M = "model.layers.*.self_attn.", "model.layers.*.mlp."


class LocalHeads(ParallelStyle):
    """the attention's head counts become the rank's own (its view() reads them)"""
    def __init__(self, cut_norms):
        super().__init__()
        self.cut_norms = cut_norms

    def _apply(self, module, mesh):
        n, r = mesh.size(), mesh.get_local_rank()
        module.num_heads //= n
        module.num_key_value_heads //= n
        if self.cut_norms:   # the per-head norms of this rank's heads
            for ln, h in ((module.q_layernorm, module.num_heads), (module.k_layernorm, module.num_key_value_heads)):
                ln.norms = nn.ModuleList(list(ln.norms)[r * h:(r + 1) * h])
        return module


def _t(cut_norms):
    model = AutoModelForCausalLM.from_pretrained(DIR)
    plan = {A + "q_proj": ColwiseParallel(), A + "k_proj": ColwiseParallel(), A + "v_proj": ColwiseParallel(),
            A + "o_proj": RowwiseParallel(), "model.layers.*.self_attn": LocalHeads(cut_norms),
            M + "gate_proj": ColwiseParallel(), M + "up_proj": ColwiseParallel(), M + "down_proj": RowwiseParallel(),
            "lm_head": ColwiseParallel(output_layouts=Replicate())}
    return tpdiag.Target(model=model, plan=plan, vocab_size=model.config.vocab_size)


def heads_only():   # the per-head norms left whole: rank 1 normalises heads 2,3 with heads 0,1's norms
    return _t(False)


def norms_cut():    # each rank keeps its own heads' norms: correct
    return _t(True)
