"""ruff is part of the test suite, so a lint error fails CI like any other test."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff is not installed (pip install ruff)")
@pytest.mark.parametrize("args", [["check"], ["format", "--check"]], ids=["lint", "format"])
def test_ruff(args: list[str]) -> None:
    proc = subprocess.run(
        ["ruff", *args, "kvoff", "tests", ".ci"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
