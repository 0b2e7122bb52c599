"""Shared pytest setup: the CUDA marker skips itself without a CUDA build and a GPU."""

from __future__ import annotations

import pytest
import torch


def cuda_skip_reason() -> str | None:
    """Why CUDA tests cannot run here, or None when they can."""
    import kvoff._build_info as info

    if not info.WITH_CUDA:
        return "kvoff was built without CUDA kernels (CPU torch or KVOFF_ENABLE_CUDA=OFF)"
    if not torch.cuda.is_available():
        return "no CUDA device is available"
    return None


def pytest_report_header(config: pytest.Config) -> str:
    """Which kvoff the tests import: the editable build, or an installed wheel (wheel-smoke)."""
    import kvoff

    return f"kvoff {kvoff.__version__} from {kvoff.__file__.rsplit('/', 1)[0]}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = cuda_skip_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
