"""runner/host_threads.py: the launcher's own CPU threads on a CPU compare - max(1, cores // the
largest degree) - unless the user set OMP_NUM_THREADS / MKL_NUM_THREADS; GPU compares keep torch's
default. The ranks keep one thread whatever the launcher runs (their records' bits depend on it:
a CPU sum's bits follow the thread count)."""
import torch

from tpdiag.runner import host_threads


def test_cpu_compare_shares_the_cores_with_its_largest_world(monkeypatch):
    monkeypatch.setattr(host_threads, "cores", lambda: 8)
    assert host_threads.launcher_threads("cpu", (1, 2), environ={}) == 4
    assert host_threads.launcher_threads("cpu", (1, 2, 4, 8), environ={}) == 1
    assert host_threads.launcher_threads("cpu", (1, 16), environ={}) == 1  # never 0
    monkeypatch.setattr(host_threads, "cores", lambda: 2)
    assert host_threads.launcher_threads("cpu", (1, 2), environ={}) == 1


def test_the_users_thread_count_is_left_alone(monkeypatch):
    monkeypatch.setattr(host_threads, "cores", lambda: 8)
    for var in host_threads.USER_VARS:
        assert host_threads.launcher_threads("cpu", (1, 2), environ={var: "3"}) is None
    # an empty value is no choice (OpenMP reads it as unset)
    assert host_threads.launcher_threads("cpu", (1, 2), environ={"OMP_NUM_THREADS": ""}) == 4


def test_gpu_compares_keep_torchs_default():
    assert host_threads.launcher_threads("cuda", (1, 2), environ={}) is None


def test_apply_sets_this_process_threads(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    monkeypatch.setattr(host_threads, "cores", lambda: 6)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert host_threads.apply("cpu", (1, 2)) == 3
        assert torch.get_num_threads() == 3
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        torch.set_num_threads(2)  # the user's own count, kept
        assert host_threads.apply("cpu", (1, 2)) is None
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_a_cpu_reduction_follows_the_thread_count():
    """Why the ranks' count stays fixed and the launcher's may not reach them: a CPU sum's bits
    depend on the thread count (the control: a fixed count gives the same bits)."""
    before = torch.get_num_threads()
    a = torch.randn(512, 2048, generator=torch.Generator().manual_seed(0))
    try:
        torch.set_num_threads(1)
        one = a.sum()
        assert torch.equal(one, a.sum())
        torch.set_num_threads(2)
        two = a.sum()
    finally:
        torch.set_num_threads(before)
    assert not torch.equal(one, two)
