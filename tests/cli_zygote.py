"""run_cli's CLI processes fork from a parent that has imported torch once (conftest.run_cli).

Each `python -m tpdiag.cli` the tests start imports torch and torch.distributed.tensor (with
torch._dynamo): ~3 s of CPU a command on the 2-core CI machine, a command or more a test. This
server imports those modules once per pytest process and forks a child for each command. The
child is a process of its own, as under subprocess.run: it takes the caller's environment, working
directory and arguments, imports tpdiag fresh and runs `tpdiag.cli` as `python -m` would
(`__main__`, sys.path[0] the working directory), writes stdout and stderr to files, exits with
the command's code, and starts its own fork server and ranks as any CLI process does. Only
modules that read no tpdiag setting are preloaded, and conftest starts a fresh interpreter
instead wherever the environment differs from this server's in a variable read at interpreter
or torch start-up (STARTUP_PREFIXES). TPDIAG_TEST_CLI_ZYGOTE=0: every command a fresh interpreter.

Protocol (stdin / stdout lines of JSON): {"ready": true} once the imports are done; then for each
request {"args", "env", "cwd", "out", "err"}: {"pid"}, then {"rc"} when that child has exited
(negative: killed by that signal, as subprocess reports it).
"""
import json
import os
import sys

# environment variables read when the interpreter or torch starts: a request whose values differ
# from the server's goes to a fresh interpreter (conftest.run_cli)
STARTUP_PREFIXES = ("PYTHON", "OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS", "LD_", "TORCH", "PYTORCH", "CUDA",
                    "NCCL", "TRITON", "MALLOC", "TMPDIR", "TPDIAG_TEST_CLI_ZYGOTE")
PRELOAD = ("torch", "torch.distributed.tensor", "torch.distributed.tensor.parallel", "torch._dynamo")


def startup_env(env: dict) -> dict:
    return {k: v for k, v in env.items() if k.startswith(STARTUP_PREFIXES)}


def _child(req: dict, proto) -> int:
    """In the forked child: become the CLI process and run it; its exit code. The caller exits
    with it through SystemExit, so the child ends as an interpreter does (atexit, finalizers,
    flushed files)."""
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
    sys.path[0] = os.getcwd()  # `python -m`: the working directory first
    sys.argv = ["-m", *req["args"]]
    try:
        runpy.run_module("tpdiag.cli", run_name="__main__", alter_sys=True)
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


def serve() -> None:
    for name in PRELOAD:
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
                sys.exit(code)
        proto_out.write(json.dumps({"pid": pid}) + "\n")
        proto_out.flush()
        _, status = os.waitpid(pid, 0)
        rc = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        proto_out.write(json.dumps({"rc": rc}) + "\n")
        proto_out.flush()


if __name__ == "__main__":
    serve()
