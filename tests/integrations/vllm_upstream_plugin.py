"""The pytest plugin and helpers loaded into the subprocess that runs vLLM's own tests against
kvoff (tests/integrations/test_vllm_upstream.py; ``-p vllm_upstream_plugin``, this folder on
``PYTHONPATH``).

* :func:`kvoff_cpu_manager`: what the adapted ``make_cpu_manager`` (vLLM's test_manager.py) and
  the adapted ``CPUOffloadingManager(num_chunks=...)`` lines (test_scheduler.py) call instead of
  vLLM's ``CPUOffloadingManager``: kvoff's ``KvoffOffloadingManager`` with the same arguments.
* The plugin (active only when ``KVOFF_UPSTREAM_REPORT`` names a file): counts, per upstream
  test, the constructions of kvoff's manager and spec and of vLLM's ``CPUOffloadingManager`` and
  ``CPUOffloadingSpec`` (its subclasses included), records every test's outcome with its
  one-line failure message, and writes them as JSON to that file at the session's end.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
from collections.abc import Callable, Generator
from typing import Any

import pytest

REPORT_ENV = "KVOFF_UPSTREAM_REPORT"

#: vLLM's CPUOffloadingManager arguments -> the value that leaves the feature off in vLLM (such
#: an argument is dropped when kvoff's manager does not take it and it has this value).
VLLM_OFF_VALUES: dict[str, Any] = {
    "cache_policy_module_path": None,
    "store_threshold": 0,
    "max_tracker_size": 64_000,
}
#: vLLM's argument names -> kvoff's, where they differ.
KVOFF_NAMES: dict[str, str] = {"num_chunks": "num_blocks", "cache_policy": "eviction_policy"}

_current: list[str | None] = [None]  # the node id of the upstream test running now
_counts: dict[str, dict[str, int]] = {}
_tests: dict[str, dict[str, str]] = {}
_collect_errors: list[dict[str, str]] = []


def kvoff_cpu_manager(
    num_chunks: int,
    cache_policy: str = "lru",
    cache_policy_module_path: str | None = None,
    enable_events: bool = False,
    store_threshold: int = 0,
    max_tracker_size: int = 64_000,
) -> Any:
    """kvoff's ``KvoffOffloadingManager`` built from vLLM's ``CPUOffloadingManager`` arguments.

    Each argument goes to kvoff's parameter of the same name, or of the name in
    :data:`KVOFF_NAMES`. An argument kvoff's constructor has no parameter for is dropped when it
    has vLLM's "off" value (:data:`VLLM_OFF_VALUES`) and otherwise raises a TypeError naming it,
    so the tests that use it fail on it, visibly.
    """
    from kvoff.integrations.vllm import KvoffOffloadingManager

    vllm_args: dict[str, Any] = {
        "num_chunks": num_chunks, "cache_policy": cache_policy,
        "cache_policy_module_path": cache_policy_module_path, "enable_events": enable_events,
        "store_threshold": store_threshold, "max_tracker_size": max_tracker_size,
    }  # fmt: skip
    params = inspect.signature(KvoffOffloadingManager).parameters
    kwargs: dict[str, Any] = {}
    unsupported: list[str] = []
    for name, value in vllm_args.items():
        if name in params:
            kwargs[name] = value
        elif KVOFF_NAMES.get(name) in params:
            kwargs[KVOFF_NAMES[name]] = value
        elif name not in VLLM_OFF_VALUES or value != VLLM_OFF_VALUES[name]:
            unsupported.append(f"{name}={value!r}")
    if unsupported:
        raise TypeError(f"kvoff's KvoffOffloadingManager takes no {', '.join(unsupported)}")
    manager = KvoffOffloadingManager(**kwargs)
    assert type(manager) is KvoffOffloadingManager, type(manager)  # kvoff is under test
    return manager


def _counting(cls: type, kind: str) -> None:
    """Counts every construction of ``cls`` (and, through ``super().__init__``, of its
    subclasses) under the running test's node id, before the constructor runs."""
    init: Callable[..., None] = cls.__init__  # type: ignore[misc]

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        counts = _counts.setdefault(_current[0] or "<no test>", {})
        counts[kind] = counts.get(kind, 0) + 1
        init(self, *args, **kwargs)

    cls.__init__ = __init__  # type: ignore[misc]


def pytest_configure(config: pytest.Config) -> None:
    if not os.environ.get(REPORT_ENV):
        return
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
    from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

    from kvoff.integrations.vllm import KvoffOffloadingManager, KvoffOffloadingSpec

    _counting(KvoffOffloadingManager, "kvoff_manager")
    _counting(KvoffOffloadingSpec, "kvoff_spec")
    _counting(CPUOffloadingManager, "vllm_manager")
    _counting(CPUOffloadingSpec, "vllm_spec")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator:
    _current[0] = item.nodeid
    yield
    _current[0] = None


def _message(report: pytest.TestReport) -> str:
    """The failure's one-line message (pytest's short summary line), or the skip reason."""
    longrepr = report.longrepr
    if isinstance(longrepr, tuple):  # a skip: (path, line, reason)
        return str(longrepr[2])
    crash = getattr(longrepr, "reprcrash", None)
    text = getattr(crash, "message", None) or str(longrepr)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return " ".join(lines)[:400]


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if not os.environ.get(REPORT_ENV):
        return
    rec = _tests.setdefault(report.nodeid, {"outcome": "passed", "message": ""})
    if rec["outcome"] in ("failed", "error"):
        return  # keep the first failure (a teardown error after a failed call adds nothing)
    if report.failed:
        rec["outcome"] = "failed" if report.when == "call" else "error"
        rec["message"] = _message(report)
    elif report.skipped:
        rec["outcome"] = "xfailed" if hasattr(report, "wasxfail") else "skipped"
        rec["message"] = _message(report)
    elif report.when == "call" and hasattr(report, "wasxfail"):
        rec["outcome"] = "xpassed"


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if os.environ.get(REPORT_ENV) and report.failed:
        _collect_errors.append({"nodeid": report.nodeid, "error": str(report.longrepr)[-3000:]})


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    path = os.environ.get(REPORT_ENV)
    if not path:
        return
    report = {
        "exitstatus": int(exitstatus), "tests": _tests, "counts": _counts,
        "collect_errors": _collect_errors,
    }  # fmt: skip
    with open(path, "w") as f:
        json.dump(report, f, indent=1, sort_keys=True)
