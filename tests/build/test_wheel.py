"""The release path: `.ci/build-wheel` builds a wheel against the installed torch,
`.ci/check_wheel.py` vets it, and `.ci/wheel-smoke` installs it into a fresh virtual environment
and runs the smoke test there (import, a CPU block copy through torch.ops.kvoff, a manager round
trip, `kvoff replay --limit 50`, `kvoff info`).

One wheel is built per session (about half a minute on 2 cores: the build tree
build/wheel-<label>-<tag>/ is kept between runs). It is built under ``LDFLAGS=-static-libstdc++``,
as a packager's toolchain may link (issue 12: such a build once carried its own copy of
libstdc++ and crashed on the first bad input), so the same build also checks that kvoff links
the shared C++ runtime whatever the flags (tests/build/test_cxx_runtime.py has the rest).
Marked `wheel`: `pytest -m "not wheel"` skips it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from filelock import FileLock
from test_cxx_runtime import _cxx_runtime  # (tests/build is on sys.path, as for pytest)

from kvoff import _build_metadata as meta

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.wheel


STATIC_LDFLAGS = "-static-libstdc++"


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHON": sys.executable}


def _build_caches() -> list[Path]:
    label = meta.local_label(torch.version.cuda)
    return sorted(ROOT.glob(f"build/wheel-{label}-*/CMakeCache.txt"))


@pytest.fixture(scope="module")
def wheel(run_tmp_path: Path) -> Path:
    """The wheel, built once per test run: xdist workers that run this module's tests share
    it (one build tree, so one build at a time)."""
    out = run_tmp_path / "dist"
    with FileLock(str(run_tmp_path / "wheel.lock")):
        found = list(out.glob("kvoff-*.whl"))
        if found:
            return found[0]
        # LDFLAGS only seeds a build tree's first configure: a kept tree configured without
        # them is configured again (its objects stay; only the links are redone)
        for cache in _build_caches():
            if STATIC_LDFLAGS not in cache.read_text():
                cache.unlink()
        proc = subprocess.run(
            ["bash", str(ROOT / ".ci/build-wheel"), str(out)],
            cwd=ROOT, env={**_env(), "LDFLAGS": STATIC_LDFLAGS},
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
        (whl,) = out.glob("kvoff-*.whl")
        return whl


def _check(whl: Path, tmp_path: Path) -> tuple[int, dict]:
    report = tmp_path / "check.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / ".ci/check_wheel.py"), str(whl), "--json", str(report)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    return proc.returncode, json.loads(report.read_text())


def test_wheel_name_pin_and_contents(wheel: Path, tmp_path: Path) -> None:
    label = meta.local_label(torch.version.cuda)
    assert wheel.name.startswith(f"kvoff-{meta.BASE_VERSION}+{label}-")
    rc, record = _check(wheel, tmp_path)
    assert rc == 0, record["failures"]
    assert record["requires_dist"][0] == meta.torch_requirement(torch.__version__)
    assert record["extension_runpath"] == ["$ORIGIN/../torch/lib"]
    assert "libtorch_cpu.so" in record["extension_needed"]
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
    assert not [n for n in names if "libtorch" in n or "libc10" in n]


def _rewrite(src: Path, dst: Path, edit) -> Path:
    """Copy wheel `src` to `dst`, passing each (name, bytes) through `edit` (None drops it)."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for item in zin.infolist():
            data = edit(item.filename, zin.read(item.filename))
            if data is not None:
                zout.writestr(item, data)
        extra = edit("<extra>", b"")
        if extra:
            for name, data in extra:
                zout.writestr(name, data)
    return dst


def test_check_rejects_a_wheel_carrying_torch_libraries(wheel: Path, tmp_path: Path) -> None:
    def edit(name: str, data: bytes):
        if name == "<extra>":
            return [("kvoff/.libs/libtorch_cpu.so", b"\x7fELF"), ("kvoff/libc10.so", b"")]
        return data

    bad = _rewrite(wheel, tmp_path / wheel.name, edit)
    rc, record = _check(bad, tmp_path)
    assert rc == 1
    assert any("carries torch/CUDA libraries" in f for f in record["failures"])


def test_check_rejects_an_unpinned_torch(wheel: Path, tmp_path: Path) -> None:
    pin = meta.torch_requirement(torch.__version__).encode()

    def edit(name: str, data: bytes):
        if name.endswith(".dist-info/METADATA"):
            return data.replace(b"Requires-Dist: " + pin, b"Requires-Dist: torch>=2.4")
        return None if name == "<extra>" else data

    bad = _rewrite(wheel, tmp_path / wheel.name, edit)
    rc, record = _check(bad, tmp_path)
    assert rc == 1
    assert any("lacks the torch pin" in f for f in record["failures"])


def test_check_rejects_a_wrong_label(wheel: Path, tmp_path: Path) -> None:
    other = "cu130" if torch.version.cuda is None else "cpu"
    label = meta.local_label(torch.version.cuda)
    renamed = tmp_path / wheel.name.replace(f"+{label}-", f"+{other}-")
    _rewrite(wheel, renamed, lambda n, d: None if n == "<extra>" else d)
    rc, record = _check(renamed, tmp_path)
    assert rc == 1
    assert any(f"expected {meta.BASE_VERSION}+{label}" in f for f in record["failures"])


def test_wheel_smoke_in_a_fresh_environment(wheel: Path, tmp_path: Path) -> None:
    proc = subprocess.run(
        ["bash", str(ROOT / ".ci/wheel-smoke"), str(wheel)],
        cwd=tmp_path,
        env={**_env(), "KVOFF_SMOKE_DIR": str(tmp_path),
             "KVOFF_SMOKE_RECORD": str(tmp_path / "record.json")},
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    venv_site = tmp_path / "venv" / "lib"
    assert f"kvoff {meta.full_version(torch.version.cuda)} from {venv_site}" in out
    for line in (
        "smoke: torch.ops.kvoff.copy_blocks byte-exact on CPU",
        "smoke: CPUOffloadingManager store / lookup / load / evict round trip",
        "smoke: kvoff replay --limit 50: 50 requests",
        "runtime matches: yes",
        "kvoff wheel-smoke: OK",
    ):
        assert line in out
    record = json.loads((tmp_path / "record.json").read_text())
    assert record["wheel"]["name"] == wheel.name
    assert record["wheel"]["size_bytes"] == wheel.stat().st_size
    assert record["build_info"]["runtime_matches"] is True
    assert record["replay_limit_50"]["requests"] == 50


def _offline_parent_python(tmp_path: Path) -> Path:
    """A virtual environment whose base interpreter has no torch while the environment itself
    has (the GPU machines' python3 is such a venv): Debian's /usr/bin/python3 makes the venv,
    and a .pth file gives it this interpreter's packages (kvoff's editable install left out, as
    the offline mode requires)."""
    base = Path("/usr/bin/python3")
    probe = subprocess.run(
        [str(base), "-c", "import venv, ensurepip, sys; import importlib.util as u; "
         "sys.exit(0 if u.find_spec('torch') is None else 1)"],
        capture_output=True, check=False,
    )  # fmt: skip
    if not base.exists() or probe.returncode != 0:
        pytest.skip("needs /usr/bin/python3 with venv and without torch")
    parent = tmp_path / "parent"
    subprocess.run([str(base), "-m", "venv", "--without-pip", str(parent)], check=True)
    packages = tmp_path / "packages"
    packages.mkdir()
    import site

    for site_dir in site.getsitepackages():
        for entry in Path(site_dir).iterdir():
            low = entry.name.lower()
            if low.startswith(("kvoff", "_kvoff", "__editable__")) or low.endswith(".pth"):
                continue
            if not (packages / entry.name).exists():
                (packages / entry.name).symlink_to(entry)
    purelib = subprocess.run(
        [str(parent / "bin/python"), "-c",
         "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    (Path(purelib) / "parent_packages.pth").write_text(f"{packages}\n")
    return parent / "bin/python"


def test_wheel_smoke_offline_from_a_venv_interpreter(wheel: Path, tmp_path: Path) -> None:
    """KVOFF_SMOKE_SYSTEM_SITE=1 with a python3 that is itself a venv, and no package index:
    nothing is downloaded, torch comes from that venv (issue 12: it used to run `pip install
    torch`, and --system-site-packages only showed the base interpreter's packages)."""
    parent = _offline_parent_python(tmp_path)
    smoke_dir = tmp_path / "smoke"
    proc = subprocess.run(
        ["bash", str(ROOT / ".ci/wheel-smoke"), str(wheel)],
        cwd=tmp_path,
        env={**os.environ, "PYTHON": str(parent), "KVOFF_SMOKE_SYSTEM_SITE": "1",
             "KVOFF_SMOKE_DIR": str(smoke_dir), "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": ""},
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert f"kvoff {meta.full_version(torch.version.cuda)} from {smoke_dir / 'venv' / 'lib'}" in out
    assert "kvoff wheel-smoke: OK" in out


_BAD_CALL = """
import sys, torch
torch.ops.load_library(sys.argv[1])
src = [torch.zeros(4, 8, dtype=torch.uint8)]
dst = [torch.zeros(4, 8, dtype=torch.uint8)]
try:
    torch.ops.kvoff.copy_blocks(src, dst, torch.tensor([0]), torch.tensor([7]), "auto", 0)
except IndexError as exc:
    print(exc)
"""


def test_a_wheel_built_under_static_libstdcxx_ldflags_keeps_the_shared_runtime(
    wheel: Path, tmp_path: Path
) -> None:
    """The reproduction of issue 12: before the fix, a build under these LDFLAGS linked
    libstdc++ into _C and the message below came out as "kvoff.copy_blocks: dst_block_ids["
    (a SIGSEGV on the H100 machine)."""
    caches = _build_caches()
    assert caches and all(
        f"CMAKE_MODULE_LINKER_FLAGS:STRING={STATIC_LDFLAGS}" in c.read_text() for c in caches
    ), "the wheel was not linked under the static LDFLAGS"
    with zipfile.ZipFile(wheel) as zf:
        names = [n for n in zf.namelist() if n.startswith("kvoff/") and n.endswith(".so")]
        zf.extractall(tmp_path, members=names)
    modules = {Path(n).name.split(".")[0]: tmp_path / n for n in names}
    assert {"_C", "_scheduler", "_bench"} <= set(modules), names
    check = _cxx_runtime()
    for module in modules.values():
        assert check.runtime_problems(module) == [], module.name
    run = subprocess.run(
        [sys.executable, "-c", _BAD_CALL, str(modules["_C"])],
        capture_output=True, text=True, check=False, cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    assert "dst_block_ids[0] = 7 is out of range for dst[0] with 4 blocks" in run.stdout
