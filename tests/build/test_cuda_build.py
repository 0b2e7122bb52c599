"""The CUDA variant of kvoff, built and exercised on a machine without a GPU (issue 12).

On the first GPU run, every bad input crashed the CUDA build of ``kvoff._C`` (CPU tensors
too): the release wheel from ``.ci/build-wheel`` and the editable build alike. CI machines have
no GPU, but ``nvcc`` is there and a CUDA build of torch installs from PyPI, and everything up to
the first kernel launch (the build, the link, loading the module, argument checks and their
error messages) runs without a GPU. This test builds the CUDA release wheel against such a torch
in its own virtual environment, vets it with ``.ci/check_wheel.py`` (label, pin, run path, GPU
code for the recorded architectures, the shared C++ runtime), installs it there, and runs the
op and worker tests against it: the error-path tests run with CPU tensors through the CUDA
build, the CUDA-device tests skip for want of a GPU.

Where the installed torch is itself a CUDA build (a GPU machine), the whole suite already runs
on the CUDA variant and this test skips. The CUDA torch comes from:

* ``KVOFF_CUDA_TORCH_PYTHON``: an interpreter that has one (and pip), else
* a virtual environment at ``build/cuda-torch-venv`` made on first use with
  ``torch==2.11.0`` (the CUDA 13.0 build on PyPI, the series of the GPU machines; about 5 GB).

Marked ``cuda_build`` (``pytest -m "not cuda_build"`` skips it).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
VENV = ROOT / "build" / "cuda-torch-venv"
CUDA_TORCH = "torch==2.11.0"
TEST_DEPS = ["numpy", "pydantic>=2.5", "pydantic-settings>=2.4", "pyyaml", "pytest>=7",
             "hypothesis>=6.80"]  # fmt: skip

pytestmark = pytest.mark.cuda_build


def _nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    for candidate in ("/usr/local/cuda/bin/nvcc",):
        if Path(candidate).exists():
            return candidate
    return None


def _pip(python: Path, *args: str) -> None:
    proc = subprocess.run(
        [str(python), "-m", "pip", "install", "--disable-pip-version-check", "-q", *args],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, f"pip install {' '.join(args)} failed:\n{proc.stderr[-3000:]}"


def _has_cuda_torch(python: Path) -> bool:
    proc = subprocess.run(
        [str(python), "-c", "import torch, sys; sys.exit(0 if torch.version.cuda else 1)"],
        capture_output=True, check=False,
    )  # fmt: skip
    return proc.returncode == 0


@pytest.fixture(scope="module")
def cuda_python() -> Path:
    if torch.version.cuda:
        pytest.skip("the installed torch is a CUDA build: the whole suite runs on the CUDA variant")
    if _nvcc() is None:
        pytest.skip("no nvcc (CUDA toolkit) on this machine")
    given = os.environ.get("KVOFF_CUDA_TORCH_PYTHON")
    if given:
        python = Path(given)
        assert _has_cuda_torch(python), f"KVOFF_CUDA_TORCH_PYTHON={given} has no CUDA torch"
    else:
        python = VENV / "bin" / "python"
        if not (python.exists() and _has_cuda_torch(python)):
            subprocess.run([sys.executable, "-m", "venv", "--clear", str(VENV)], check=True)
            _pip(python, CUDA_TORCH)
    _pip(python, *TEST_DEPS)
    return python


def test_cuda_wheel_builds_and_bad_input_raises_instead_of_crashing(
    cuda_python: Path, tmp_path: Path
) -> None:
    nvcc = _nvcc()
    assert nvcc is not None
    env = {
        **os.environ,
        "PYTHON": str(cuda_python),
        "CUDACXX": nvcc,
        "TORCH_CUDA_ARCH_LIST": "9.0",  # one architecture keeps the build short (H100/H200)
        "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 2),
    }
    build = subprocess.run(
        ["bash", str(ROOT / ".ci/build-wheel"), str(tmp_path)],
        env=env, cwd=ROOT, capture_output=True, text=True, check=False,
    )  # fmt: skip
    log = build.stdout + build.stderr
    assert build.returncode == 0, log[-6000:]
    assert "contents, run path and C++ runtime OK" in log  # .ci/check_wheel.py passed
    (wheel,) = tmp_path.glob("kvoff-*+cu*.whl")
    _pip(cuda_python, "--no-deps", "--force-reinstall", str(wheel))

    # The venv's pytest script: sys.path[0] is its bin/, so `import kvoff` finds the wheel,
    # not the source tree.
    tests = subprocess.run(
        [str(cuda_python.parent / "pytest"), "-p", "no:cacheprovider",
         "tests/test_ops.py", "tests/test_worker.py"],
        env={**os.environ, "PYTHONNOUSERSITE": "1"}, cwd=ROOT,
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    out = tests.stdout + tests.stderr
    assert tests.returncode == 0, out[-6000:]
    assert f"kvoff {wheel.name.split('-')[1]} from {cuda_python.parent.parent}" in out  # the wheel
    assert "no CUDA device is available" in out  # only the device tests skipped
    passed = re.search(r"(\d+) passed", out)
    assert passed is not None and int(passed[1]) >= 100, out[-2000:]
