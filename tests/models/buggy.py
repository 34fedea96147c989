"""Planted sharding bug in layer 1's down-projection: a custom row-parallel style whose
reduction rescales its result (as a wrong average / wrong world size would)."""
import tpdiag
from tpdiag.models import tiny_llama
from tpdiag.models.plans import llama_plan


def target():
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import RowwiseParallel

    class BuggyRowwise(RowwiseParallel):
        @staticmethod
        def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
            out = outputs.redistribute(placements=[Replicate()], async_op=False).to_local()
            return out * (1.0 + 1.0 / 64)

    model = tiny_llama.build("tiny-llama")
    plan = llama_plan()
    del plan["layers.*.feed_forward.w2"]
    plan["layers.0.feed_forward.w2"] = RowwiseParallel()
    plan["layers.1.feed_forward.w2"] = BuggyRowwise()
    return tpdiag.Target(model=model, plan=plan, vocab_size=model.cfg.vocab_size)
