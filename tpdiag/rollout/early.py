"""`tpdiag rollout --jobs`: the lanes started before this process builds its own model.

A lane's start is seconds (CUDA, its process group, building the model); so is this process's build
of the model and its first configuration (the one the processed-logprobs collector reads). Started
one after the other, as until 60c0432, the lanes waited for both. Here they start first, in a thread
of their own, and this process builds and computes beside them.

What must not change: this process's bits. A launch puts the rank environment (CUBLAS_WORKSPACE_CONFIG
among it, tpdiag.runner.determinism.RANK_ENV) into this process's environment, and the cuBLAS workspace
follows a process's first GEMM - so the caller waits until every lane has been launched
(`wait_launched`), puts its environment back, and only then builds and computes. The ranks take
their environment from the fork server (tpdiag.runner.start_context.prestart), not from this process's.
Bad input found by the build (a token outside the vocabulary, a model that cannot load) cancels the
lanes: their worlds end at once, their ranks killed, and the error is the command's.
"""
from __future__ import annotations

import shutil
import tempfile
import threading


class Launches:
    """How many worlds will start, and how many have."""

    def __init__(self):
        self._cond = threading.Condition()
        self._expected: int | None = None
        self._seen = 0

    def expect(self, n: int) -> None:
        with self._cond:
            self._expected = n
            self._cond.notify_all()

    def one(self) -> None:
        with self._cond:
            self._seen += 1
            self._cond.notify_all()

    def wait(self, finished) -> None:
        """Until every expected world has started, or finished() (the lanes' thread ended)."""
        with self._cond:
            while not finished() and (self._expected is None or self._seen < self._expected):
                self._cond.wait(0.05)


class Early:
    """lanes.run(...) in a thread, started now."""

    def __init__(self, rc, seqs, cfgs, counts: dict, groups: int, threads: int, on_status=None):
        from tpdiag.rollout import lanes

        self.cancel = threading.Event()
        self.launches = Launches()
        self._result: dict = {}
        self._error: BaseException | None = None
        self._work = tempfile.mkdtemp(prefix="tpdiag-rollout-")

        def body():
            try:
                if cfgs:
                    self._result = lanes.run(rc, seqs, cfgs, counts, self._work, groups, threads, on_status,
                                             cancel=self.cancel, launches=self.launches)
            except BaseException as e:  # noqa: BLE001 - handed to the caller's thread by result()
                self._error = e

        self._thread = threading.Thread(target=body, name="tpdiag-rollout-lanes", daemon=True)
        self._thread.start()

    def wait_launched(self) -> None:
        self.launches.wait(lambda: not self._thread.is_alive())

    def result(self) -> dict:
        """Every lane's results, once all have ended (the lanes' own error raised here)."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._result

    def close(self) -> None:
        """End the lanes if they still run (the caller failed), wait for them, drop their files."""
        if self._thread.is_alive():
            self.cancel.set()
        self._thread.join()
        shutil.rmtree(self._work, ignore_errors=True)


def start(rc, seqs, cfgs, counts, groups, big, on_status):
    """(the lanes of every configuration but the first TP=1 one - this process's, _lead - started
    now, the environment to put back at the end): once every lane is launched, this process's
    environment is put back - before its first GEMM (tpdiag.rollout.early)."""
    import os

    import torch

    from tpdiag.runner.determinism import RANK_ENV

    saved = {k: os.environ.get(k) for k in RANK_ENV}
    first = next((c for c in cfgs if c.tp == 1), None)
    early = Early(rc, seqs, [c for c in cfgs if c is not first], counts, groups,
                  1 if big > 1 else torch.get_num_threads(), on_status)
    try:
        early.wait_launched()
    except BaseException:
        early.close()
        raise
    finally:
        put_back(saved)
    return early, saved


def put_back(saved: dict) -> None:
    import os

    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
