"""Build configuration: KVOFF_ENABLE_CUDA=ON without a CUDA torch is a clear configure error."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pybind11
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


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
    proc = _configure(tmp_path / "build", f"-DKVOFF_ENABLE_CUDA={value}")
    assert proc.returncode != 0
    err = " ".join(proc.stderr.split())
    if value == "ON":
        assert "KVOFF_ENABLE_CUDA=ON, but the installed torch" in err
        assert "CPU build" in err and "AUTO" in err
    else:
        assert "KVOFF_ENABLE_CUDA='MAYBE' is not one of AUTO, ON, OFF" in err


def _configure(build: Path, *defs: str, env: dict[str, str] | None = None):
    return subprocess.run(
        [
            "cmake", "-S", str(ROOT), "-B", str(build), "-G", "Ninja",
            f"-DPython_EXECUTABLE={sys.executable}", f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}", "-DKVOFF_BUILD_TESTS=OFF",
            *defs,
        ],
        capture_output=True, text=True, check=False, env=env,
    )  # fmt: skip


_needs_nvcc = pytest.mark.skipif(
    not _cmake_ok() or shutil.which("nvcc") is None,
    reason="needs cmake >= 3.28 and nvcc on PATH (the CUDA architecture list is only resolved "
    "when CUDA code is compiled)",
)


def _has_arch(ninja: str, sm: int, *, ptx: bool = False) -> bool:
    """Whether nvcc is asked for SASS (or, with ptx, PTX) of sm_<sm>. CMake writes
    `arch=compute_90,code=[sm_90]`; a CUDA torch's CMake writes `arch=compute_90,code=sm_90`."""
    code = f"compute_{sm}" if ptx else f"sm_{sm}"
    return re.search(rf"arch=compute_{sm},code=\[?{code}\b", ninja) is not None


@_needs_nvcc
def test_cuda_architectures_default_and_override(tmp_path: Path) -> None:
    """Without TORCH_CUDA_ARCH_LIST the release default (Ampere, Hopper, Blackwell, PTX for
    newer GPUs) is used; TORCH_CUDA_ARCH_LIST (environment) replaces it. Both are printed and
    the resolved list reaches the nvcc command lines, on a CPU torch (CMake's own flags) and on
    a CUDA torch (torch's gencode flags)."""
    env = {k: v for k, v in os.environ.items() if k != "TORCH_CUDA_ARCH_LIST"}
    proc = _configure(tmp_path / "default", env=env)
    assert proc.returncode == 0, proc.stderr
    m = re.search(r"kvoff: CUDA (\d+)\.(\d+)", proc.stdout)
    assert m is not None, proc.stdout
    if (int(m[1]), int(m[2])) >= (12, 8):
        default, sms, ptx = "8.0;8.6;9.0;10.0;12.0+PTX", (80, 86, 90, 100, 120), 120
    else:
        default, sms, ptx = "8.0;8.6;9.0+PTX", (80, 86, 90), 90
    assert f"architectures {default}" in proc.stdout
    ninja = (tmp_path / "default" / "build.ninja").read_text()
    for sm in sms:
        assert _has_arch(ninja, sm), sm
    assert _has_arch(ninja, ptx, ptx=True)
    assert not _has_arch(ninja, 80, ptx=True)

    proc = _configure(tmp_path / "env", env={**env, "TORCH_CUDA_ARCH_LIST": "8.0 9.0+PTX 8.0"})
    assert proc.returncode == 0, proc.stderr
    assert "architectures 8.0;9.0+PTX\n" in proc.stdout  # the repeated 8.0 dropped
    ninja = (tmp_path / "env" / "build.ninja").read_text()
    assert _has_arch(ninja, 80) and _has_arch(ninja, 90) and _has_arch(ninja, 90, ptx=True)
    assert not _has_arch(ninja, 100) and not _has_arch(ninja, 86)


@_needs_nvcc
def test_bad_cuda_architecture_is_a_configure_error(tmp_path: Path) -> None:
    proc = _configure(tmp_path / "b", "-DTORCH_CUDA_ARCH_LIST=9.0;sm_100")
    assert proc.returncode != 0
    err = " ".join(proc.stderr.split())
    assert "TORCH_CUDA_ARCH_LIST entry 'sm_100' is not of the form MAJOR.MINOR[a|f][+PTX]" in err


def _check_wheel_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("check_wheel", ROOT / ".ci" / "check_wheel.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_wheel_check_finds_missing_gpu_code() -> None:
    """.ci/check_wheel.py compares a CUDA wheel's cubins/PTX (cuobjdump) with the recorded
    architecture list: a missing one would fail at the first kernel launch on that GPU."""
    cw = _check_wheel_module()
    listing = (
        "ELF file    1: _C.1.sm_80.cubin\n"
        "ELF file    2: _C.2.sm_90.cubin\n"
        "ELF file    3: _C.3.sm_120.cubin\n"
        "PTX file    1: _C.1.sm_120.ptx\n"
    )
    code = cw.parse_cuobjdump(listing)
    assert code == {"sass": ["sm_120", "sm_80", "sm_90"], "ptx": ["sm_120"]}
    assert cw._missing_gpu_code("8.0 9.0 12.0+PTX", code) == []
    missing = cw._missing_gpu_code("8.0 8.6 9.0+PTX", code)
    assert missing == [
        "kvoff/_C has no sm_86 cubin although 8.6 was asked for",
        "kvoff/_C has no sm_90 PTX although 9.0+PTX was asked for",
    ]
