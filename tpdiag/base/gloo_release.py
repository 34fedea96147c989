"""Hand a collective's tensors back on the calling thread, so that no gloo worker thread frees a
Python tensor while the interpreter exits.

Why: a gloo collective runs on one of the process group's C++ worker threads, which holds the
work - and through it the collective's tensors - until it has finished its loop iteration, a
moment AFTER the caller already saw the collective complete. When the caller then drops its
own references, a tensor that still has a Python object is kept alive by the worker's; the
worker's release then needs the GIL. If that happens while the interpreter is finalizing (the
collective was among the last things the script did), the worker thread is torn down inside a
C++ destructor and the process dies with "terminate called without an active exception"
(SIGABRT, exit code -6 / torchrun rc 1), after all its work was done (torch 2.13 on the 2-core
CI machine, issue 61: a two-rank gloo script whose last act is 20 all_reduces of fresh tensors,
no destroy_process_group, aborted 15 ranks over 40 runs; the same waiting as below after each
all_reduce, 0 over 40; with destroy_process_group at the end, 0 over 10). settle() waits, after the collective returned, until the worker let go of
each tensor (its C++ use count is back to the caller's own), so the last release - and any
freeing - happens here, on the caller's thread, with the GIL held.
"""
from __future__ import annotations

import time

# how long to wait for a worker thread to let go (normally microseconds: it has completed the
# work and only has to end its loop iteration); past this give up and go on as before
LIMIT_S = 5.0


def is_gloo(group=None) -> bool:
    import torch.distributed as dist

    return dist.is_initialized() and str(dist.get_backend(group)).lower() == "gloo"


def settle(tensors, group=None) -> None:
    """Wait until no gloo worker still holds any of `tensors` (each referenced by the caller
    once, through the list it passed to the collective). Other backends: nothing to do."""
    if not is_gloo(group):
        return
    for t in tensors:
        if t is not None:
            _wait(t, 1)  # the caller's list: 1 C++ owner, the Python object


def _wait(t, owners: int) -> None:
    """Until `t` has no more than `owners` C++ owners (a gloo worker let go), or LIMIT_S passed."""
    deadline = time.monotonic() + LIMIT_S
    while t._use_count() > owners and time.monotonic() < deadline:
        time.sleep(0.0002)


def all_reduce_settled(t, group=None, **kw) -> None:
    """dist.all_reduce(t, ...) that returns only once no gloo worker holds `t` any more. The
    wait is for the count of owners `t` had before the call (a tensor a kernel also keeps
    elsewhere - a pool, a saved activation - has more than one for good): a tensor tpdiag
    reduces last in a user's step (the grad norm of tpdiag.clip_grad_norm_, the loss's sums)
    is then never freed by a worker while the user's script exits."""
    import torch.distributed as dist

    before = t._use_count()
    dist.all_reduce(t, group=group, **kw)
    if is_gloo(group):
        _wait(t, before)
