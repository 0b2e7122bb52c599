"""The suite's own layout: pytest collects every test folder (a folder that matches one of
``norecursedirs``, as ``build`` does by pytest's default, would be skipped silently, and with
it every test inside)."""

from __future__ import annotations

import fnmatch
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent


def test_every_test_folder_is_collected(pytestconfig: pytest.Config) -> None:
    patterns = pytestconfig.getini("norecursedirs")
    folders = sorted(p for p in TESTS.rglob("*") if p.is_dir() and any(p.glob("test_*.py")))
    assert TESTS / "build" in folders
    skipped = [
        str(p.relative_to(TESTS))
        for p in folders
        for part in p.relative_to(TESTS).parts
        if any(fnmatch.fnmatch(part, pat) for pat in patterns)
    ]
    assert skipped == [], f"pytest would skip these test folders (norecursedirs): {skipped}"


def test_folder_markers_select_and_deselect() -> None:
    """tests/build/ carries the ``build`` marker, so ``-m "not build"`` (the quick loop) leaves
    it out and ``-m build`` keeps it."""

    def collected(expr: str) -> list[str]:
        out = subprocess.run(
            [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
             "-m", expr, str(TESTS / "build" / "test_style.py")],
            check=False, capture_output=True, text=True, cwd=TESTS.parent,
        ).stdout  # fmt: skip
        return [line for line in out.splitlines() if "::" in line]

    assert collected("build") and all("test_style" in t for t in collected("build"))
    assert collected("not build") == []
