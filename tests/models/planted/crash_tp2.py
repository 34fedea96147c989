"""A user's tiny-llama whose process dies in its forward at TP=2 (a rank killed: the OOM killer, a
segfault in a kernel of its own): TP=1 runs, the TP=2 world fails."""
import os

import tpdiag
from tpdiag.models import tiny_llama
from tpdiag.models.plans import llama_plan


def target():
    import torch.distributed as dist

    model = tiny_llama.build("tiny-llama")
    if dist.is_initialized() and dist.get_world_size() == 2:
        model.register_forward_pre_hook(lambda mod, args: os._exit(9))
    return tpdiag.Target(model=model, plan=llama_plan(), vocab_size=model.cfg.vocab_size)
