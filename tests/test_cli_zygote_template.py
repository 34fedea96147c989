"""run_cli's commands take their fork server from cli_zygote's template (torch already imported),
not from a fresh `python -c` that imports torch again (~3 s of CPU a command on the 2-core CI
machine). Since the launcher set PYTHONSAFEPATH for its fork server (ec304e1), the template read it
as a changed start-up variable and every command fell back to a fresh server, unnoticed: the
tests passed, only slower. A rank here reports its parent - the fork server - by its command line."""
import json
import os
import time

import pytest

import conftest
from conftest import run_cli

TARGET = '''import multiprocessing, os
import tpdiag
from tpdiag.models import tiny_llama


def target():
    if multiprocessing.parent_process() is not None:  # a rank: its parent is the fork server
        with open(os.path.join({out!r}, f"rank-{{os.getpid()}}"), "w") as f:
            f.write(open(f"/proc/{{os.getppid()}}/cmdline").read().replace("\\0", " "))
    model = tiny_llama.build("tiny-llama", n_layers=1)
    return tpdiag.Target(model=model, plan={{}}, vocab_size=model.cfg.vocab_size)
'''


def test_ranks_fork_from_the_template(tmp_path):
    if os.environ.get("TPDIAG_TEST_CLI_ZYGOTE", "1") == "0" or os.environ.get("TPDIAG_TEST_FORKSERVER_TEMPLATE", "1") == "0":
        pytest.skip("the tests' CLI server or its fork-server template is off")
    if not os.path.isdir("/proc/self"):
        pytest.skip("no /proc: a rank cannot read its parent's command line")
    # the server for this process's environment as it is now: one whose start-up environment an
    # earlier in-process test changed is replaced at the next command (conftest._zygote)
    if conftest._zygote(dict(os.environ)) is not None:
        conftest._ZYGOTE_LOCK.release()
    z = conftest._start_zygote()
    deadline = time.time() + 120
    while not z.ready():  # until the server has imported torch, run_cli takes a fresh interpreter
        assert time.time() < deadline, "the CLI server did not finish its imports"
        time.sleep(0.1)
    seen = tmp_path / "seen"
    seen.mkdir()
    model = tmp_path / "model.py"
    model.write_text(TARGET.format(out=str(seen)))
    p = run_cli("compare", "--model", f"py:{model}:target", "--tp", "1,1", "--forward-only", "--no-baseline",
                "--no-confirm", "--no-judge-downstream", "--out", str(tmp_path / "r"), "--format", "json")
    assert p.returncode == 0, p.stderr[-2000:]
    assert json.loads(p.stdout)["status"] == "bitwise"
    parents = [f.read_text() for f in seen.iterdir()]
    assert parents, "no rank built the target"
    # the template is a fork of the server: its command line is the server's own
    assert all("cli_zygote.py" in c and "forkserver" not in c for c in parents), parents


def test_torch_s_inductor_cache_dir_never_changes_the_servers_start_up_environment(monkeypatch):
    """torch writes TORCHINDUCTOR_CACHE_DIR into its process's environment the first time inductor's
    cache directory is asked for (a transformers model built or saved in-process asks): a start-up
    variable for run_cli's server, whose change replaced the server mid-session (its imports again,
    the next command a fresh interpreter: test_hf_fixes' olmo2 test). conftest, imported where it is
    unset, sets it first - to a fresh directory of the session's (a warm default cache hid a CI
    failure: tests/test_recipe_compiled.py), which torch then keeps."""
    import shutil
    import subprocess
    import sys

    from cli_zygote import startup_env
    from torch._inductor.runtime.cache_dir_utils import cache_dir, default_cache_dir

    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    p = subprocess.run([sys.executable, "-c", "import os, conftest; print(os.environ.get('TORCHINDUCTOR_CACHE_DIR'))"],
                       cwd=os.path.dirname(os.path.abspath(__file__)), env=env, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stderr[-2000:]
    preset = p.stdout.strip().splitlines()[-1]
    assert os.path.isdir(preset) and not os.listdir(preset) and preset != os.path.abspath(default_cache_dir())
    shutil.rmtree(preset)
    before = startup_env(dict(os.environ))
    assert cache_dir() == os.environ["TORCHINDUCTOR_CACHE_DIR"]
    assert startup_env(dict(os.environ)) == before
    # unset, the same call writes it: the change conftest's preset keeps from the server
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    assert "TORCHINDUCTOR_CACHE_DIR" not in startup_env(dict(os.environ))
    cache_dir()
    assert "TORCHINDUCTOR_CACHE_DIR" in startup_env(dict(os.environ))


WHO = '''import os, sys
print(open(f"/proc/{os.getppid()}/cmdline").read().replace("\\0", " "))
print(repr(sys.path[:2]))
'''


def test_run_module_forks_from_the_server_unless_its_pythonpath_shadows_a_preload(tmp_path):
    """conftest.run_module (torchrun's launchers) forks `python -m` from run_cli's server where the
    PYTHONPATH it is given adds folders that hold no package the server preloaded - sys.path then as
    `python -m` sets it (the working directory, the PYTHONPATH folders) - and runs a fresh interpreter
    where such a folder would shadow one (torch/ or pandas.py there: the fresh one imports that)."""
    if os.environ.get("TPDIAG_TEST_CLI_ZYGOTE", "1") == "0" or not os.path.isdir("/proc/self"):
        pytest.skip("the tests' CLI server is off, or no /proc to read a parent's command line")
    if conftest._zygote(dict(os.environ)) is not None:  # the server for the environment as it is now
        conftest._ZYGOTE_LOCK.release()
    z = conftest._start_zygote()
    deadline = time.time() + 120
    while not z.ready():
        assert time.time() < deadline, "the CLI server did not finish its imports"
        time.sleep(0.1)
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "who_runs_me.py").write_text(WHO)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(mods), os.environ.get("PYTHONPATH")) if p))
    p = conftest.run_module("who_runs_me", env=env, cwd=tmp_path, timeout=60)
    assert p.returncode == 0, p.stderr
    parent, path = p.stdout.splitlines()[:2]
    assert "cli_zygote.py" in parent, parent
    assert path == repr([str(tmp_path), str(mods)]), path
    for shadow in ("torch", "pandas.py"):
        d = tmp_path / f"shadow-{shadow}"
        d.mkdir()
        if shadow.endswith(".py"):
            (d / shadow).write_text("")
        else:
            (d / shadow).mkdir()
        (d / "who_runs_me.py").write_text(WHO)
        e = dict(env, PYTHONPATH=os.pathsep.join([str(d), env["PYTHONPATH"]]))
        p = conftest.run_module("who_runs_me", env=e, cwd=tmp_path, timeout=60)
        assert p.returncode == 0, p.stderr
        assert "cli_zygote.py" not in p.stdout.splitlines()[0], (shadow, p.stdout)
