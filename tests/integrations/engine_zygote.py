"""Starts engines for the tests' EngineRunner by forking one process that has already imported
vLLM (a zygote), instead of starting a fresh interpreter per engine:

    python engine_zygote.py        # then, on stdin, one JSON request per line

Importing torch, kvoff and vLLM's ``LLM`` takes about 17 s of the 26 s an engine of the suite
takes to answer on a 2-core machine (2026-11-30); a forked child starts with all of it done.
Each request ``{"plan": path, "result": path, "log": path, "status": path}`` forks a child that
runs the plan exactly as ``python vllm_engine.py PLAN RESULT`` would (vllm_engine.run_plan),
with its stdout and stderr in ``log``. When the child ends, this process writes its exit
status to ``status`` (a file written aside and renamed: the caller polls for it): 0 on
success, the exit code otherwise, 128 + the signal for a child killed by one. Several
children may run at once (a test can act on the world while its engine runs).

Only in-process plans come here: plans with ``multiprocessing`` or ``env`` set environment
variables that vLLM may read while it is imported, so they start a fresh interpreter
(tests/integrations/conftest.py decides). Nothing has run a parallel torch region before the
fork (libgomp's thread team does not survive one), and the BLAS libraries that numpy and
SciPy bring start their threads again after a fork.
"""

from __future__ import annotations

import json
import os
import select
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import vllm_engine  # torch, kvoff's worker and the fault hooks
from vllm import LLM, SamplingParams  # noqa: F401  (the import the children skip)
from vllm.inputs import TokensPrompt  # noqa: F401
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: F401


def _child(request: dict[str, str]) -> None:
    """Runs one plan in the forked child and never returns."""
    code = 1
    try:
        null = os.open(os.devnull, os.O_RDONLY)  # not the caller's pipe of requests
        os.dup2(null, 0)
        os.close(null)
        fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        os.setpgrp()  # the caller kills the child's whole group on a time-out
        vllm_engine.run_plan(request["plan"], request["result"])
        code = 0
    except BaseException:  # everything goes to the log, like an uncaught exception would
        import traceback

        traceback.print_exc()
    vllm_engine.exit_now(code)


def _write_status(path: str, status: int) -> None:
    code = os.waitstatus_to_exitcode(status)
    aside = path + ".partial"
    with open(aside, "w") as fh:
        fh.write(str(code if code >= 0 else 128 - code))
    os.replace(aside, path)


def main() -> None:
    children: dict[int, str] = {}  # pid -> status path
    stdin = sys.stdin.buffer
    buffered = b""
    while True:
        ready, _, _ = select.select([stdin], [], [], 0.05)
        if ready:
            chunk = os.read(stdin.fileno(), 1 << 16)
            if not chunk:  # the caller went away: the children finish on their own
                break
            buffered += chunk
            while b"\n" in buffered:
                line, buffered = buffered.split(b"\n", 1)
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    _child(request)
                children[pid] = request["status"]
                with open(request["status"] + ".pid", "w") as fh:  # for the caller's time-out
                    fh.write(str(pid))
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            path = children.pop(pid, None)
            if path is not None:
                _write_status(path, status)
    for pid, path in children.items():
        _, status = os.waitpid(pid, 0)
        _write_status(path, status)


if __name__ == "__main__":
    main()
    sys.stdout.flush()
    os._exit(0)
