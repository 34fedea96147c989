"""py: targets opted in to the meta-device build with init rules that break its contract."""
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "examples"))
import py_target  # noqa: E402


def degree_seeded(device):
    """Reseeds from the world size: TP=2 draws other weights than TP=1 (a negative control)."""
    t = py_target.target()

    def init(fqn, module):
        if hasattr(module, "reset_parameters"):
            torch.manual_seed(1000 + dist.get_world_size())
            module.reset_parameters()

    t.init = init
    return t


def leaves_one(device):
    """Initialises every module but the head: its weight would be uninitialised memory."""
    t = py_target.target()

    def init(fqn, module):
        if fqn != "head" and hasattr(module, "reset_parameters"):
            module.reset_parameters()

    t.init = init
    return t
