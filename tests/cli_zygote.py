"""run_cli's CLI processes fork from a parent that has imported torch once (conftest.run_cli).

Each `python -m tpdiag.cli` the tests start imports torch and torch.distributed.tensor (with
torch._dynamo): ~3 s of CPU a command on the 2-core CI machine, a command or more a test. This
server imports those modules (and, where installed, transformers' model machinery, which an hf:
model's command imports) once per pytest process and forks a child for each command. The
child is a process of its own, as under subprocess.run: it takes the caller's environment, working
directory and arguments, imports tpdiag fresh and runs `tpdiag.cli` as `python -m` would
(`__main__`, sys.path[0] the working directory), writes stdout and stderr to files, exits with
the command's code, and starts its own fork server and ranks as any CLI process does. Only
modules that read no tpdiag setting are preloaded, and conftest starts a fresh interpreter
instead wherever the environment differs from this server's in a variable read at interpreter
or torch start-up (STARTUP_PREFIXES). TPDIAG_TEST_CLI_ZYGOTE=0: every command a fresh interpreter.

Protocol (stdin / stdout lines of JSON): {"ready": true} once the imports are done; then for each
request {"args", "env", "cwd", "out", "err"} and optionally "module" (another `python -m` module than
tpdiag.cli: torchrun's launcher, conftest.run_module): {"pid"}, then {"rc"} when that child has exited
(negative: killed by that signal, as subprocess reports it).

The command's own fork server (runner/start_context.py: a fresh `python -c` that imports torch, ~3 s of
CPU a command) forks, where it can, from a template process forked from this server before the
command imports tpdiag (_Template): it takes the command's environment, working directory and
sys.path as that interpreter would have them, imports the same preload and runs
multiprocessing's own forkserver.main, a child of the command as the spawned one is. Anything
else - other interpreter flags, a start-up variable other than RANK_ENV's and PYTHONPATH set by the
launcher - and the command spawns its fork server as usual. TPDIAG_TEST_FORKSERVER_TEMPLATE=0: never.
"""
import json
import os
import sys

# environment variables read when the interpreter or torch starts: a request whose values differ
# from the server's goes to a fresh interpreter (conftest.run_cli)
# (and the settings of transformers and the Hub: HF_*, TRANSFORMERS_*, USE_TF, ...; typer's
# TYPER_USE_RICH, read when typer is imported; matplotlib's MPLBACKEND, MPLCONFIGDIR)
STARTUP_PREFIXES = ("PYTHON", "OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS", "LD_", "TORCH", "PYTORCH", "CUDA",
                    "NCCL", "TRITON", "MALLOC", "TMPDIR", "TPDIAG_TEST_CLI_ZYGOTE", "HF_", "HUGGINGFACE",
                    "TRANSFORMERS", "USE_", "SAFETENSORS", "TOKENIZERS", "ACCELERATE", "XDG_", "TYPER", "_TYPER",
                    "MPL")
# pandas (diff.csv and the records frames: every compare, diff and report), typer, click and rich
# (the CLI itself): ~0.1-0.3 s of CPU a command, which each command imported on its own; matplotlib's
# figure and Agg canvas (tpdiag/reports/plots.py: every `tpdiag report`, ~0.4 s of CPU each)
PRELOAD = ("torch", "torch.distributed.tensor", "torch.distributed.tensor.parallel", "torch._dynamo", "pandas",
           "click", "typer", "rich.console", "matplotlib.figure", "matplotlib.backends.backend_agg")
# where installed: transformers' model machinery, which an hf: model's command imports and its fork
# server preloads (runner/launch.py) - ~1.5 s of CPU each, twice an hf: compare, on the CI machine
PRELOAD_IF_INSTALLED = ("transformers.modeling_utils", "transformers.models.auto.modeling_auto")


def startup_env(env: dict) -> dict:
    return {k: v for k, v in env.items() if k.startswith(STARTUP_PREFIXES)}


_SERVER_ENV: dict = {}  # this server's environment at its start (its imports saw these)
_BASE_PATH: list = []  # its sys.path without its script's folder and its PYTHONPATH entries
_FORKSERVER_CMD = "from multiprocessing.forkserver import main; "


def _pythonpath(env: dict) -> list:
    return [os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]


class _Template:
    """A process forked before the command imports tpdiag, waiting to become its fork server."""

    def __init__(self):
        import socket

        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.pid = os.fork()
        if self.pid == 0:
            self.sock.close()
            _become_fork_server(theirs)  # never returns
        theirs.close()

    def spawnv_passfds(self, orig, path, args, passfds):
        """multiprocessing.util.spawnv_passfds, in the command: the fork server from the template
        where it stands in for `python -c <forkserver main>`, else orig."""
        import ast
        import multiprocessing.util as mp_util
        import socket

        from tpdiag.runner.determinism import RANK_ENV
        from tpdiag.runner.start_context import SAFE_PATH_MARK

        env = dict(os.environ)
        theirs = startup_env(env)
        theirs.pop("PYTHONPATH", None)  # set by the launcher (_import_root_first): sys.path below
        for k, v in RANK_ENV.items():
            if k not in _SERVER_ENV and theirs.get(k) == v:
                theirs.pop(k)
        mine = startup_env(_SERVER_ENV)
        mine.pop("PYTHONPATH", None)
        # PYTHONSAFEPATH set by the launcher for its fork server alone (runner/start_context.py _safe_path):
        # what it changes, no working directory on sys.path, the template's sys.path below does.
        # Compared as a start-up variable, it sent every command since ec304e1 to a fresh fork
        # server (~3 s of CPU a command importing torch again)
        if env.get(SAFE_PATH_MARK) == "1" and "PYTHONSAFEPATH" not in mine:
            theirs.pop("PYTHONSAFEPATH", None)
        flags = [*mp_util._args_from_interpreter_flags(), "-c"]  # the template's own: same interpreter
        if self.sock is None or args[1:-1] != flags or not args[-1].startswith(_FORKSERVER_CMD) or theirs != mine:
            return orig(path, args, passfds)
        call = ast.parse(args[-1][len(_FORKSERVER_CMD):], mode="eval").body
        fd_args = [ast.literal_eval(a) for a in call.args[:2]]
        if fd_args != list(passfds):
            return orig(path, args, passfds)
        preload = ast.literal_eval(call.args[2])
        pp = _pythonpath(env)
        # `python -c`'s: the working directory ('') first, unless PYTHONSAFEPATH
        cwd = [] if env.get("PYTHONSAFEPATH") else [""]
        sys_path = [*cwd, *dict.fromkeys(pp), *(p for p in _BASE_PATH if p not in pp)]
        msg = json.dumps({"env": env, "cwd": os.getcwd(), "preload": preload, "sys_path": sys_path})
        socket.send_fds(self.sock, [msg.encode()], list(passfds))
        self.sock.close()
        self.sock = None
        return self.pid


def _become_fork_server(sock) -> None:
    """In the template: wait for the command's request, then be its fork server; exit when the
    command ends without one."""
    import socket

    code = 0
    try:
        try:
            msg, fds, _, _ = socket.recv_fds(sock, 1 << 20, 2)
        except OSError:
            msg = b""
        sock.close()
        if not msg:
            os._exit(0)
        req = json.loads(msg)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        sys.path[:] = req["sys_path"]
        sys.argv = ["-c"]
        from multiprocessing import forkserver

        forkserver.main(fds[0], fds[1], req["preload"])
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _child(req: dict, proto) -> int:
    """In the forked child: become the CLI process and run it; its exit code. The caller exits
    with it through _exit, so the child ends as an interpreter does (threads joined, atexit and
    finalizers run, stdout and stderr flushed) without its heap's teardown."""
    import runpy
    import traceback

    proto.close()  # the server's reply pipe: nothing buffered (written after each fork)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    for fd, path in ((1, req["out"]), (2, req["err"])):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    module = req.get("module", "tpdiag.cli")
    if module == "tpdiag.cli":
        sys.path[0] = os.getcwd()  # `python -m`: the working directory first
    else:  # `python -m`'s sys.path: the working directory, the request's PYTHONPATH, the interpreter's own
        pp = _pythonpath(req["env"])
        sys.path[:] = [os.getcwd(), *dict.fromkeys(pp), *(p for p in _BASE_PATH if p not in pp)]
    sys.argv = ["-m", *req["args"]]
    if module == "tpdiag.cli" and req["env"].get("TPDIAG_TEST_FORKSERVER_TEMPLATE", "1") != "0":
        import functools
        import multiprocessing.util as mp_util

        template = _Template()
        mp_util.spawnv_passfds = functools.partial(template.spawnv_passfds, mp_util.spawnv_passfds)
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


def _exit(code: int) -> None:
    """End the child as an interpreter's exit does - wait for its non-daemon threads, run its
    atexit callbacks (multiprocessing's finalizers among them), flush stdout and stderr - then
    leave without tearing the heap down: the child shares the server's torch-laden heap
    copy-on-write, and clearing every module's objects at exit touched (so copied) all of it -
    1.0 s of a `tpdiag --help`'s 1.1 s on the 2-core CI machine, 0.1 s this way."""
    import atexit
    import threading

    try:
        threading._shutdown()
        atexit._run_exitfuncs()
    finally:
        for f in (sys.stdout, sys.stderr):
            try:
                f.flush()
            except Exception:  # noqa: BLE001 - a closed stream: nothing left to write
                pass
        os._exit(code)


def serve() -> None:
    _SERVER_ENV.update(os.environ)
    skip = {sys.path[0], *_pythonpath(_SERVER_ENV)}
    _BASE_PATH[:] = [p for p in sys.path if p not in skip]
    for name in PRELOAD:
        __import__(name)
    import importlib.util

    if importlib.util.find_spec("transformers") is not None:
        for name in PRELOAD_IF_INSTALLED:
            __import__(name)
    proto_in, proto_out = sys.stdin, os.fdopen(os.dup(1), "w")
    proto_out.write(json.dumps({"ready": True}) + "\n")
    proto_out.flush()
    for line in proto_in:
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = _child(req, proto_out)
            finally:
                _exit(code)
        proto_out.write(json.dumps({"pid": pid}) + "\n")
        proto_out.flush()
        _, status = os.waitpid(pid, 0)
        rc = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        proto_out.write(json.dumps({"rc": rc}) + "\n")
        proto_out.flush()


if __name__ == "__main__":
    serve()
