"""Runs the C++ core's GoogleTest binary and reports each gtest case as its own pytest test.

The binary (``kvoff_core_tests``) is built with kvoff when GoogleTest is installed; its path is
``kvoff._build_info.GTEST_BINARY``. It runs once per session with ``--gtest_output=json``;
each ``Suite.Case`` listed by ``--gtest_list_tests`` becomes one parametrized test that passes
when that case passed and otherwise fails with the case's failure messages.

When the binary is missing: skipped locally (install GoogleTest and rebuild), failed under CI
(the ``CI`` environment variable is set), where the C++ tests must run.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import kvoff._build_info as build_info
import pytest

_RUN_TIMEOUT_S = 600


def _binary() -> str | None:
    path = build_info.GTEST_BINARY
    if path and os.path.isfile(path) and os.access(path, os.X_OK):
        return path
    return None


def _missing_reason() -> str:
    path = build_info.GTEST_BINARY
    where = f"(expected at {path})" if path else "(GoogleTest was not found at build time)"
    return (
        f"the C++ core's GoogleTest binary kvoff_core_tests is not built {where}; install "
        "GoogleTest (`apt-get install libgtest-dev`) and rebuild kvoff "
        "(`pip install --no-build-isolation -e .`)"
    )


def _list_cases(binary: str) -> list[str]:
    """``Suite.Case`` names from ``--gtest_list_tests`` (parameter comments dropped)."""
    out = subprocess.run(
        [binary, "--gtest_list_tests"], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    cases: list[str] = []
    suite = ""
    for line in out.splitlines():
        if not line.strip():
            continue
        name = line.split("#", 1)[0].strip()
        if not line.startswith(" "):
            suite = name  # "Suite."
        elif name:
            cases.append(suite + name)
    return cases


BINARY = _binary()
CASES = _list_cases(BINARY) if BINARY else []


def test_gtest_binary_is_built():
    if BINARY is not None:
        assert CASES, f"{BINARY} --gtest_list_tests listed no test cases"
        return
    if os.environ.get("CI"):
        pytest.fail(_missing_reason() + " — CI must run the C++ tests")
    pytest.skip(_missing_reason())


@pytest.fixture(scope="session")
def gtest_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Runs the whole binary once; maps ``Suite.Case`` to its JSON record."""
    assert BINARY is not None
    report = Path(tmp_path_factory.mktemp("gtest")) / "report.json"
    proc = subprocess.run(
        [BINARY, f"--gtest_output=json:{report}"],
        capture_output=True,
        text=True,
        timeout=_RUN_TIMEOUT_S,
        check=False,
    )
    if not report.exists():
        pytest.fail(
            f"{BINARY} exited with status {proc.returncode} without writing its JSON report "
            f"(crashed?).\nstdout tail:\n{proc.stdout[-4000:]}\nstderr tail:\n{proc.stderr[-4000:]}"
        )
    data = json.loads(report.read_text())
    results: dict[str, dict] = {}
    for suite in data.get("testsuites", []):
        for case in suite.get("testsuite", []):
            results[f"{suite['name']}.{case['name']}"] = case
    results["__output__"] = {"stdout": proc.stdout, "returncode": proc.returncode}
    return results


@pytest.mark.parametrize(
    "case",
    CASES or [pytest.param("<no gtest binary>", marks=pytest.mark.skip(reason="no gtest binary"))],
)
def test_gtest_case(case: str, gtest_results: dict[str, dict]) -> None:
    record = gtest_results.get(case)
    if record is None:
        out = gtest_results["__output__"]
        pytest.fail(
            f"gtest case {case} is missing from the JSON report (binary exit status "
            f"{out['returncode']}); stdout tail:\n{out['stdout'][-4000:]}"
        )
    if record.get("result") == "SKIPPED" or record.get("status") == "NOTRUN":
        pytest.skip(f"gtest skipped {case}")
    failures = record.get("failures", [])
    if failures:
        pytest.fail(
            f"gtest case {case} failed:\n" + "\n\n".join(f["failure"] for f in failures),
            pytrace=False,
        )
