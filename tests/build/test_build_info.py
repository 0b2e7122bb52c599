"""Build metadata (wheel label, torch pin), kvoff.build_info() (kvoff/install_info.py) and
`kvoff info` (kvoff/tools/info.py)."""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys

import kvoff._build_info as b
import pytest
import torch

import kvoff
import kvoff.ops
from kvoff import _build_metadata as meta
from kvoff import _version_check
from kvoff import install_info as info_mod
from kvoff.install_info import GPUInfo, arch_covers, build_info
from kvoff.tools.cli import main
from kvoff.tools.info import info_report


# ---- wheel label and torch pin -------------------------------------------------------------
@pytest.mark.parametrize(
    ("cuda", "label"),
    [(None, "cpu"), ("", "cpu"), ("13.0", "cu130"), ("12.8", "cu128"), ("12.10", "cu1210")],
)
def test_local_label(cuda: str | None, label: str) -> None:
    assert meta.local_label(cuda) == label


def test_bad_cuda_version_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"'thirteen' is not MAJOR\.MINOR"):
        meta.local_label("thirteen")


@pytest.mark.parametrize(
    ("torch_version", "pin"),
    [
        ("2.13.0+cpu", "torch==2.13.*"),
        ("2.11.0+cu130", "torch==2.11.*"),
        ("2.13.1", "torch==2.13.*"),
        ("2.14.0.dev20261101+cpu", "torch==2.14.*"),
    ],
)
def test_torch_requirement_pins_the_series(torch_version: str, pin: str) -> None:
    assert meta.torch_requirement(torch_version) == pin
    assert meta.dependencies(torch_version)[0] == pin


def test_bad_torch_version_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"'nightly' does not start with MAJOR\.MINOR"):
        meta.torch_requirement("nightly")


def test_dynamic_metadata_hook() -> None:
    """What scikit-build-core asks for at build time, from the installed torch."""
    assert meta.dynamic_metadata("version", {}) == meta.full_version(torch.version.cuda)
    deps = meta.dynamic_metadata("dependencies", None)
    assert deps[0] == meta.torch_requirement(torch.__version__)
    assert set(meta.BASE_DEPENDENCIES) <= set(deps)
    with pytest.raises(RuntimeError, match="not 'readme'"):
        meta.dynamic_metadata("readme", {})
    with pytest.raises(RuntimeError, match="takes no settings"):
        meta.dynamic_metadata("version", {"input": "x"})


def test_this_install_carries_its_label_and_pin() -> None:
    """The editable install was built by the same hook: the metadata pip recorded, the compiled
    _build_info and kvoff.__version__ agree, and the installed torch satisfies the pin."""
    expected = meta.full_version(torch.version.cuda)
    assert kvoff.__version__ == b.VERSION == expected
    assert importlib.metadata.version("kvoff") == expected
    requires = importlib.metadata.requires("kvoff") or []
    assert meta.torch_requirement(torch.__version__) in requires


# ---- architecture coverage -----------------------------------------------------------------
@pytest.mark.parametrize(
    ("archs", "capability", "covered"),
    [
        (["9.0"], (9, 0), True),  # exact cubin
        (["8.0"], (8, 6), True),  # same major, later minor
        (["8.6"], (8, 0), False),  # earlier minor: no
        (["9.0"], (10, 0), False),  # other major, no PTX
        (["9.0+PTX"], (10, 0), True),  # PTX JIT for a newer GPU
        (["12.0+PTX"], (9, 0), False),  # PTX never runs on an older GPU
        (["9.0a"], (9, 0), True),
        (["9.0a"], (9, 1), False),  # arch-specific: exactly that one
        (["8.0", "8.6", "9.0", "10.0", "12.0+PTX"], (12, 1), True),  # release default
        (["8.0", "8.6", "9.0", "10.0", "12.0+PTX"], (7, 5), False),  # Turing: not built
        ([], (9, 0), False),
    ],
)
def test_arch_covers(archs: list[str], capability: tuple[int, int], covered: bool) -> None:
    assert arch_covers(archs, capability) is covered


def test_arch_covers_rejects_bad_entries() -> None:
    with pytest.raises(ValueError, match=r"'sm_90' is not MAJOR\.MINOR"):
        arch_covers(["sm_90"], (9, 0))


# ---- build_info ------------------------------------------------------------------------------
def test_build_info_of_this_install() -> None:
    assert kvoff.build_info is build_info and kvoff.BuildInfo is info_mod.BuildInfo
    info = build_info()
    assert info.runtime_matches and info.problems == ()
    assert info.version == kvoff.__version__
    assert info.built_torch == b.TORCH_VERSION and info.running_torch == torch.__version__
    assert info.with_cuda is b.WITH_CUDA
    assert info.cxx_compiler == b.CXX_COMPILER and info.cxx_compiler.split()[0] in {
        "GNU", "Clang", "AppleClang", "IntelLLVM",
    }  # fmt: skip
    assert info.copy_mechanisms["cpu"] == ("memcpy", "per_block")
    if not b.WITH_CUDA:
        assert info.cuda_architectures == () and "cuda" not in info.copy_mechanisms
    d = json.loads(info.to_json())
    assert d["runtime_matches"] is True and d["version"] == info.version
    assert d["copy_mechanisms"]["cpu"] == ["memcpy", "per_block"]


def test_copy_mechanisms_listed_are_accepted_by_the_op() -> None:
    from kvoff.ops import MECHANISMS

    for names in build_info().copy_mechanisms.values():
        assert set(names) <= set(MECHANISMS)


def test_build_info_reports_a_cuda_mismatch(monkeypatch: pytest.MonkeyPatch) -> None:
    other = None if torch.version.cuda else "13.0"
    monkeypatch.setattr(b, "TORCH_CUDA_VERSION", other)
    info = build_info()
    assert not info.runtime_matches
    (problem,) = info.problems
    want = meta.local_label(torch.version.cuda)
    assert "CUDA" in problem and f"+{want} wheel" in problem


def test_build_info_reports_a_torch_series_mismatch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(b, "TORCH_VERSION", "2.0.1")
    (problem,) = build_info().problems
    assert "built against torch 2.0.1" in problem and "torch==2.0.*" in problem


def test_build_info_reports_an_uncovered_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CUDA build whose architectures miss the visible GPU names the GPU and the rebuild."""
    monkeypatch.setattr(b, "WITH_CUDA", True)
    monkeypatch.setattr(b, "CUDA_ARCHITECTURES", "8.0 9.0")
    monkeypatch.setattr(torch.version, "cuda", b.TORCH_CUDA_VERSION or "13.0")
    monkeypatch.setattr(b, "TORCH_CUDA_VERSION", torch.version.cuda)
    gpu = GPUInfo(0, "Fake RTX 5090", (12, 0), arch_covers(["8.0", "9.0"], (12, 0)))
    monkeypatch.setattr(info_mod, "_gpus", lambda archs: (gpu,))
    monkeypatch.setattr(info_mod, "_cuda_driver", lambda: "13.0")
    monkeypatch.setattr(kvoff.ops, "batch_copy_supported", lambda: True)
    info = build_info()
    (problem,) = info.problems
    assert "Fake RTX 5090" in problem and "TORCH_CUDA_ARCH_LIST='12.0'" in problem
    assert info.copy_mechanisms["cuda"] == ("memcpy", "batch", "kernel", "per_block")
    assert "NOT SUPPORTED" in info.format()


def test_build_info_reports_a_cuda_build_without_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(b, "WITH_CUDA", True)
    monkeypatch.setattr(b, "CUDA_ARCHITECTURES", "9.0")
    monkeypatch.setattr(torch.version, "cuda", b.TORCH_CUDA_VERSION or "13.0")
    monkeypatch.setattr(b, "TORCH_CUDA_VERSION", torch.version.cuda)
    monkeypatch.setattr(info_mod, "_gpus", lambda archs: ())
    monkeypatch.setattr(info_mod, "_cuda_driver", lambda: None)
    monkeypatch.setattr(kvoff.ops, "batch_copy_supported", lambda: True)
    info = build_info()
    (problem,) = info.problems
    assert "no GPU is visible" in problem
    assert "cuda" not in info.copy_mechanisms


def test_build_info_reports_stale_metadata(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(info_mod, "_installed_version", lambda: "0.0.9+cpu")
    (problem,) = build_info().problems
    assert "0.0.9+cpu" in problem and "reinstall" in problem


# ---- packages imported on demand -------------------------------------------------------------
def test_build_info_lists_the_packages_imported_on_demand() -> None:
    from kvoff._optional import EXTRAS

    info = build_info()
    assert list(info.optional_packages) == list(EXTRAS)
    for module, installed in info.optional_packages.items():
        found = None
        for name in EXTRAS[module].distributions:
            try:
                found = f"{name} {importlib.metadata.version(name)}"
                break
            except importlib.metadata.PackageNotFoundError:
                continue
        assert installed == found, module
    # blake3 is a dependency of kvoff, so always there; the test extra brings redis-py
    assert info.optional_packages["blake3"] == f"blake3 {importlib.metadata.version('blake3')}"
    assert info.optional_packages["redis"] is not None
    assert info.vllm_tested is (None if info.optional_packages["vllm"] is None else True)
    d = json.loads(info.to_json())
    assert d["optional_packages"] == info.optional_packages and "vllm_tested" in d


def test_kvoff_info_names_an_untested_vllm_and_a_missing_package(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An untested vLLM is reported, not a mismatch of the install (exit status 0); a missing
    package is shown with the command that installs it."""
    from kvoff import _optional

    def installed(module: str) -> tuple[str, str] | None:
        return {"vllm": ("vllm", "0.34.0"), "blake3": ("blake3", "1.0.0")}.get(module)

    monkeypatch.setattr(_optional, "installed_version", installed)
    info = build_info()
    assert info.vllm_tested is False and info.runtime_matches
    assert info.optional_packages["vllm"] == "vllm 0.34.0"
    text, status = info_report()
    assert status == 0
    assert (
        "  vLLM               0.34.0 (vllm), NOT TESTED with kvoff (tested: 0.32.0; "
        'docs/vllm.md, "Other vLLM releases")'
    ) in text.splitlines()
    assert '  redis-py           not installed: pip install "kvoff[redis]"' in text.splitlines()
    assert "  blake3             1.0.0" in text.splitlines()

    monkeypatch.setattr(_optional, "installed_version", lambda module: None)
    info = build_info()
    assert info.vllm_tested is None and info.optional_packages["vllm"] is None
    assert "tested with kvoff" not in info.format()


def test_build_info_imports_no_optional_package(tmp_path) -> None:
    """The report reads package metadata: importing vLLM would take seconds and start its
    platform detection in every `kvoff info`."""
    code = (
        "import sys, kvoff; info = kvoff.build_info(); "
        "print(sorted(m for m in ('vllm', 'matplotlib', 'redis', 'prometheus_client') "
        "if m in sys.modules))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", proc.stdout


# ---- kvoff info ------------------------------------------------------------------------------
def test_kvoff_info_text(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"kvoff {kvoff.__version__}\n")
    assert f"torch              {b.TORCH_VERSION}" in out
    assert "runtime matches: yes" in out


def test_info_report(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the command prints and its exit status, from the library's report."""
    text, status = info_report()
    assert status == 0 and text == build_info().format() and "runtime matches: yes" in text
    text, status = info_report(as_json=True)
    assert status == 0 and json.loads(text)["runtime_matches"] is True
    monkeypatch.setattr(b, "TORCH_VERSION", "2.0.1")
    text, status = info_report()
    assert status == 1 and "runtime matches: NO" in text
    assert "extensions were not loaded" not in text  # they are, in this process


def test_kvoff_info_json_and_exit_code_on_mismatch(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["info", "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["runtime_matches"] is True
    monkeypatch.setattr(b, "TORCH_VERSION", "2.0.1")
    assert main(["info", "--format", "json"]) == 1
    d = json.loads(capsys.readouterr().out)
    assert d["runtime_matches"] is False and len(d["problems"]) == 1


def test_kvoff_info_console_script(tmp_path) -> None:
    """`python -m kvoff info` runs in a fresh process (from a directory that is not the source
    root: `-m` puts the working directory first on sys.path)."""
    proc = subprocess.run(
        [sys.executable, "-m", "kvoff", "info", "--format", "json"],
        capture_output=True, text=True, check=False, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["version"] == kvoff.__version__


# ---- `kvoff info` under a torch the build does not fit ---------------------------------------
@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["/venv/bin/kvoff", "info"], True),
        (["-m", "info", "--json"], True),  # python -m kvoff info, while the package imports
        (["/venv/bin/kvoff", "replay"], False),
        (["-c"], False),
        (["/venv/bin/other", "info"], False),
        (["/venv/bin/kvoff"], False),
    ],
)
def test_invoked_as_kvoff_info(argv: list[str], expected: bool) -> None:
    assert _version_check.invoked_as_kvoff_info(argv) is expected


_FAKE_BUILD = (
    "import sys, types\n"
    "import kvoff._build_info as real\n"  # importing a submodule runs kvoff/__init__ first...
    "fake = types.ModuleType('kvoff._build_info')\n"
    "fake.__dict__.update({k: v for k, v in vars(real).items() if k.isupper()})\n"
    "fake.TORCH_VERSION = '1.13.1'\n"
    "for name in [m for m in sys.modules if m == 'kvoff' or m.startswith('kvoff.')]:\n"
    "    del sys.modules[name]\n"  # ...so forget it all and import again with the fake
    "sys.modules['kvoff._build_info'] = fake\n"
    # under a torch of another series kvoff._C would not load (undefined symbols): here too,
    # any attempt to import it fails
    "sys.modules['kvoff._C'] = None\n"
)


@pytest.mark.parametrize("as_json", [False, True])
def test_kvoff_info_reports_a_torch_mismatch_instead_of_dying(tmp_path, as_json: bool) -> None:
    """`import kvoff` refuses a torch of another series; run as `kvoff info`, the import neither
    raises nor exits the process: it leaves a package without the compiled extensions (and
    without any kvoff.tools module), and the command prints the report and returns 1."""
    argv = ["/venv/bin/kvoff", "info", *(["--format", "json"] if as_json else [])]
    code = (
        _FAKE_BUILD + f"sys.argv = {argv!r}\n"
        "import kvoff\n"
        "print('IMPORTED', sorted(m for m in sys.modules if m.startswith('kvoff.tools')))\n"
        "from kvoff.tools.cli import main\n"
        "status = main(sys.argv[1:])\n"
        "print('EXIT', status)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path
    )
    out = proc.stdout
    assert out.startswith("IMPORTED []\n"), out + proc.stderr
    assert out.rstrip().endswith("EXIT 1"), out + proc.stderr
    report = out.removeprefix("IMPORTED []\n").rsplit("EXIT", 1)[0]
    if as_json:
        d = json.loads(report)
        assert d["runtime_matches"] is False and d["copy_mechanisms"] == {}
        (problem,) = d["problems"]
    else:
        assert "runtime matches: NO" in report and "extensions were not loaded" in report
        problem = report
    assert "built against torch 1.13.1" in problem and "torch==1.13.*" in problem


def test_a_torch_mismatch_still_fails_the_import_elsewhere(tmp_path) -> None:
    code = (
        _FAKE_BUILD + "sys.argv = ['/venv/bin/kvoff', 'replay']\n"
        "try:\n"
        "    import kvoff\n"
        "except ImportError as e:\n"
        "    print(type(e).__name__)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path
    )
    assert proc.stdout.strip() == "TorchVersionMismatchError", proc.stdout + proc.stderr
