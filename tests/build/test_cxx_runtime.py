"""One C++ runtime per process (issue 12).

A CUDA build of kvoff._C crashed with SIGSEGV on the first bad input on an H100 machine: the
module carried a static copy of libstdc++ (it did not need libstdc++.so.6 and the crash was in
``std::ostream::_M_insert<unsigned long>`` inside _C.so), whose locale state does not match the
shared libstdc++ torch loads, so formatting the number in a TORCH_CHECK message broke. Here the
same cause is reproduced with ``LDFLAGS=-static-libstdc++`` (the message comes out truncated at
the first number), and these tests keep it from coming back:

* the installed extensions need libstdc++.so.6 and define none of libstdc++'s own symbols;
* the checks (the build's cmake/check_cxx_runtime.cmake and .ci/cxx_runtime.py) reject a module
  that carries a static copy and accept one that does not;
* a kvoff build under ``LDFLAGS=-static-libstdc++`` still links the shared runtime (the build
  links ``-l:libstdc++.so.6`` first, with --no-as-needed) and its error messages are whole:
  tests/build/test_wheel.py builds the release wheel under those flags and checks this.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvoff import _C, _bench, _scheduler

ROOT = Path(__file__).resolve().parents[2]
CHECK_SCRIPT = ROOT / "cmake" / "check_cxx_runtime.cmake"

pytestmark = pytest.mark.skipif(
    sys.platform != "linux" or not all(shutil.which(t) for t in ("readelf", "nm", "g++")),
    reason="needs Linux with binutils (readelf, nm) and g++",
)


def _cxx_runtime():
    spec = importlib.util.spec_from_file_location("cxx_runtime", ROOT / ".ci" / "cxx_runtime.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("module", [_C, _scheduler, _bench], ids=["_C", "_scheduler", "_bench"])
def test_installed_extensions_use_the_shared_cxx_runtime(module) -> None:
    assert _cxx_runtime().runtime_problems(Path(module.__file__)) == []


_TOY = r"""
#include <sstream>
#include <string>
extern "C" const char* toy_format(unsigned long n) {
  static std::string out;
  std::ostringstream s;
  s << "value " << n;
  out = s.str();
  return out.c_str();
}
"""


@pytest.fixture(scope="module")
def toys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The same C++ source as a shared module linked normally and with -static-libstdc++."""
    tmp = tmp_path_factory.mktemp("toys")
    src = tmp / "toy.cpp"
    src.write_text(_TOY)
    out = {}
    for name, flags in (("shared", []), ("static", ["-static-libstdc++"])):
        so = tmp / f"toy_{name}.so"
        subprocess.run(
            ["g++", "-shared", "-fPIC", "-O2", *flags, "-o", str(so), str(src)], check=True
        )
        out[name] = so
    return out


def _cmake_check(module: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["cmake", f"-DMODULE={module}", f"-DNM={shutil.which('nm')}",
         f"-DREADELF={shutil.which('readelf')}", "-P", str(CHECK_SCRIPT)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip


@pytest.mark.skipif(shutil.which("cmake") is None, reason="no cmake on PATH")
def test_the_build_check_rejects_a_static_copy_and_accepts_the_shared_runtime(toys) -> None:
    ok = _cmake_check(toys["shared"])
    assert ok.returncode == 0, ok.stderr
    bad = _cmake_check(toys["static"])
    assert bad.returncode != 0
    msg = " ".join(bad.stderr.split())
    assert "carries its own copy of the C++ runtime" in msg
    assert "_ZNSo9_M_insertImEERSoT_" in msg and "needs libstdc++.so: OFF" in msg
    assert "-static-libstdc++" in msg  # names what to look for


def test_the_python_check_agrees(toys) -> None:
    check = _cxx_runtime()
    assert check.runtime_problems(toys["shared"]) == []
    problems = check.runtime_problems(toys["static"])
    assert len(problems) == 2
    assert "does not need libstdc++.so" in problems[0]
    assert "_ZNSt6locale7classicEv" in problems[1]
