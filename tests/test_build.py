"""Build configuration: KVOFF_ENABLE_CUDA=ON without a CUDA torch is a clear configure error."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pybind11
import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def _cmake_ok() -> bool:
    exe = shutil.which("cmake")
    if exe is None:
        return False
    out = subprocess.run([exe, "--version"], capture_output=True, text=True, check=False).stdout
    major, minor = (int(x) for x in out.split()[2].split(".")[:2])
    return (major, minor) >= (3, 28)


@pytest.mark.skipif(not _cmake_ok(), reason="no cmake >= 3.28 on PATH (pip install cmake)")
@pytest.mark.parametrize("value", ["ON", "maybe"])
def test_enable_cuda_misconfiguration_is_a_configure_error(tmp_path: Path, value: str) -> None:
    if value == "ON" and torch.version.cuda:
        pytest.skip("the installed torch has CUDA: ON is a valid request here")
    proc = subprocess.run(
        [
            "cmake", "-S", str(ROOT), "-B", str(tmp_path / "build"), "-G", "Ninja",
            f"-DKVOFF_ENABLE_CUDA={value}", f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
        ],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert proc.returncode != 0
    err = " ".join(proc.stderr.split())
    if value == "ON":
        assert "KVOFF_ENABLE_CUDA=ON, but the installed torch" in err
        assert "CPU build" in err and "AUTO" in err
    else:
        assert "KVOFF_ENABLE_CUDA='MAYBE' is not one of AUTO, ON, OFF" in err
