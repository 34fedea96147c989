"""tiny-llama with head_dim 8: at TP=8 the k/v projections are 8-column GEMMs, which x86 CPU
BLAS runs through another kernel than the full GEMM (shape-dependent-gemm on a CPU)."""
import tpdiag
from tpdiag.models import tiny_llama
from tpdiag.models.plans import llama_plan


def target():
    model = tiny_llama.build("tiny-llama", dim=128, ffn_dim=256, n_layers=1)
    return tpdiag.Target(model=model, plan=llama_plan(), vocab_size=model.cfg.vocab_size)
