"""The test session's helpers exist once per process: pytest imports tests/conftest.py as `conftest`,
and files that import `tests.conftest` (the repository root is on sys.path) got a second module -
its own run_cli server started beside the first (~8-13 CPU s of imports, and its first command in a
fresh interpreter while it imported) in every worker that ran such a file. shared_run makes a name's
run once in a process without xdist too, as it does across xdist's workers."""
import uuid


def test_conftest_is_one_module_under_both_names():
    import importlib

    import conftest
    from tests.conftest import _ZYGOTE, run_cli  # as 17 test files import it

    assert importlib.import_module("tests.conftest") is conftest
    assert run_cli is conftest.run_cli and _ZYGOTE is conftest._ZYGOTE


def test_shared_run_makes_a_name_once_without_xdist(tmp_path_factory, monkeypatch):
    from conftest import shared_run

    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    made = []

    def make(out):
        made.append(out)
        out.mkdir()

    name = f"once-{uuid.uuid4().hex[:8]}"
    first = shared_run(tmp_path_factory, name, make)
    assert shared_run(tmp_path_factory, name, make) == first and made == [first] and first.is_dir()
    other = shared_run(tmp_path_factory, name + "-b", make)  # another name: another run
    assert other != first and made == [first, other]
