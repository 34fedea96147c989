"""base/user_code.py: which frames are the user's. A pyenv Python keeps site-packages inside its
stdlib directory (lib/python3.X/site-packages); the stdlib prefix took a pip-installed package of the
user's - their model package - for the standard library, so the op line (`op_at`) skipped its frames
(red team hred15). Fails on the old code: the site-packages file read internal and calling_line()
named no frame."""
import os
import sysconfig

import torch

from tpdiag.base import user_code


def _site_file() -> str:
    return os.path.join(sysconfig.get_paths()["purelib"], "users_model_pkg", "model.py")


def test_an_installed_package_of_the_users_is_their_code():
    assert not user_code._internal(_site_file())


def test_the_stdlib_torch_and_tpdiag_stay_internal():
    assert user_code._internal(os.path.join(sysconfig.get_paths()["stdlib"], "json", "decoder.py"))
    assert user_code._internal(torch.nn.functional.__file__)  # torch itself sits in site-packages
    assert user_code._internal(user_code.__file__)


def test_the_op_line_names_a_frame_in_site_packages():
    path = _site_file()
    ns = {"calling_line": user_code.calling_line}
    exec(compile("def forward():\n    return calling_line()\n", path, "exec"), ns)
    line = ns["forward"]()
    assert line is not None and line.endswith(":2 in forward") and "users_model_pkg" in line, line


def test_a_child_process_stops_at_its_bootstrap():
    """A rank forked from a fork server (the tests' CLI server, a user's launcher) holds its parent's
    frames below multiprocessing's bootstrap: an op of a built-in model (no user frame in the rank's
    own work) read the launcher's line as its `op_at` (test_own_pass_links: a linked and a rerun
    world disagreed, `tests/cli_zygote.py:138 in _become_fork_server`). Fails on the old code: the
    forked worker named this test's own line."""
    import multiprocessing

    with multiprocessing.get_context("fork").Pool(1) as pool:
        assert pool.apply(user_code.calling_line) is None
    assert user_code.calling_line() is not None  # here, in the parent: this test's own line
