"""tiny-llama with head_dim 8 and 2 kv heads: at TP=2 the k/v projections are 8-column GEMMs
(16 columns whole), which x86 CPU BLAS runs through another kernel than the full GEMM
(shape-dependent-gemm on a CPU). Its q projection's 64-column shards keep the full GEMM's kernel."""
import tpdiag
from tpdiag.models import tiny_llama
from tpdiag.models.plans import llama_plan


def target():
    model = tiny_llama.build("tiny-llama", dim=128, ffn_dim=256, n_layers=1, n_kv_heads=2)
    return tpdiag.Target(model=model, plan=llama_plan(), vocab_size=model.cfg.vocab_size)
