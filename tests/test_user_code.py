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
