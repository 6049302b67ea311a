"""Runs ``python -m MODULE ARGS`` requests in forks of one process that has already imported zoo's commands.

The ``forked`` fixture (conftest.py) starts this script once per test worker and sends it one JSON request per line
on stdin: ``{"module", "args", "cwd", "env", "stdout", "stderr", "timeout"}``. For each, this process forks; the
child takes the request's working directory, environment and standard streams (files the fixture reads back, stdin
from /dev/null), runs the module as ``__main__`` as ``python -m`` does, and exits with its status; this process
answers ``{"returncode": N}`` (-9 when the child outlived ``timeout`` and was killed). Every child starts from the
same untouched copy, so one run's state cannot reach the next; what a fresh interpreter would add is its start-up
and the 2-3 s of imports (torch above all), which the many tests of commands refusing a bad setting need not repeat.
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import sys
import time
import traceback

import zoo.run  # noqa: F401 - the imports every fork shares
import zoo.serve  # noqa: F401
import zoo.train  # noqa: F401


def child(request: dict) -> int:
    """The forked child: ``python -m`` with the request's settings; returns the exit status."""
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    stdin = os.open(os.devnull, os.O_RDONLY)
    os.dup2(stdin, 0)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    sys.path[0] = os.getcwd()  # as `python -m` puts it
    sys.argv = [request["module"], *request["args"]]
    # run afresh as __main__, as `python -m` does; the copy imported above stays with the modules that imported it
    sys.modules.pop(request["module"], None)
    try:
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    except SystemExit as exc:  # sys.exit(code): the interpreter's rules for what it exits with
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    except BaseException:  # noqa: BLE001 - what the interpreter prints for an uncaught exception
        traceback.print_exc()
        return 1
    return 0


def serve_requests() -> None:
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()  # nothing of this process's output may be left in a buffer the child inherits
        pid = os.fork()
        if pid == 0:
            status = 1
            try:
                status = child(request)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(status)
        deadline = time.monotonic() + request["timeout"]
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                returncode = os.waitstatus_to_exitcode(status)
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                returncode = -signal.SIGKILL
                break
            time.sleep(0.005)
        print(json.dumps({"returncode": returncode}), flush=True)


if __name__ == "__main__":
    serve_requests()
