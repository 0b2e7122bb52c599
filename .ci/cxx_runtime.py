"""Does a shared object use the process's shared C++ runtime, or carry a copy of its own?

A kvoff extension module that links parts of libstdc++ statically has a second set of locale
and iostream state next to the libstdc++.so.6 that torch has already loaded; formatting a
number into a stream (every TORCH_CHECK message does) then breaks: a truncated message, or a
SIGSEGV inside ``std::ostream::_M_insert<unsigned long>`` (issue 12). The build refuses such a
module (cmake/check_cxx_runtime.cmake); this is the same check for built wheels
(.ci/check_wheel.py) and for the tests, in Python.

    python3 .ci/cxx_runtime.py MODULE.so [...]     # exit 1 and say why for each bad module
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

# Defined only inside libstdc++ itself (non-template functions or explicit instantiations that
# user code never emits): std::locale::classic(), std::ios_base::Init::Init(),
# std::ostream::_M_insert<unsigned long>(unsigned long). Same list as check_cxx_runtime.cmake.
PROBE_SYMBOLS = ("_ZNSt6locale7classicEv", "_ZNSt8ios_base4InitC1Ev", "_ZNSo9_M_insertImEERSoT_")


def _run(tool: str, *args: str) -> str:
    exe = shutil.which(tool)
    if exe is None:
        raise FileNotFoundError(f"{tool} (binutils) is needed to inspect shared objects")
    return subprocess.run([exe, *args], capture_output=True, text=True, check=True).stdout


def runtime_problems(module: Path) -> list[str]:
    """What is wrong with ``module``'s C++ runtime: an empty list when it needs libstdc++.so.6
    and defines none of :data:`PROBE_SYMBOLS`.

    Raises:
        FileNotFoundError: when ``readelf`` or ``nm`` is not installed.
        subprocess.CalledProcessError: when ``module`` is not an ELF shared object.
    """
    problems = []
    dynamic = _run("readelf", "-d", str(module))
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", dynamic)
    if not any(lib.startswith("libstdc++.so") for lib in needed):
        problems.append(f"{module.name} does not need libstdc++.so (NEEDED: {needed})")
    symbols = _run("nm", "-D", "--defined-only", str(module))
    defined = set(re.findall(r" [TtWw] (\S+)$", symbols, re.M))
    copied = [s for s in PROBE_SYMBOLS if s in defined]
    if copied:
        problems.append(f"{module.name} defines libstdc++'s own symbols {copied}: a static copy")
    return problems


def main(argv: list[str]) -> int:
    bad = 0
    for path in argv:
        for problem in runtime_problems(Path(path)):
            print(f"cxx_runtime: {problem}", file=sys.stderr)
            bad = 1
    return bad


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
