"""kvoff refuses to load under a torch other than the one it was built against."""

from __future__ import annotations

import subprocess
import sys

import kvoff._build_info as info
import pytest
import torch

from kvoff import _version_check
from kvoff._version_check import (
    TorchVersionMismatchError,
    check_torch_version,
    extensions_skipped,
    extensions_wanted,
)


def test_build_recorded_the_running_torch() -> None:
    assert info.TORCH_VERSION.split("+")[0] == torch.__version__.split("+")[0]
    check_torch_version()  # no error under the torch it was built with


def test_other_torch_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(info, "TORCH_VERSION", "2.0.1")
    with pytest.raises(TorchVersionMismatchError) as err:
        check_torch_version()
    msg = str(err.value)
    assert "2.0.1" in msg and torch.__version__ in msg
    assert "pip install --no-build-isolation" in msg
    assert isinstance(err.value, ImportError)


@pytest.mark.parametrize("patch", [0, 1, 7])
def test_other_patch_release_of_the_series_loads(
    monkeypatch: pytest.MonkeyPatch, patch: int
) -> None:
    """Patch releases keep the C++ ABI: the check, like the wheel's torch==X.Y.* pin, is per
    series."""
    major, minor = torch.__version__.split(".")[:2]
    monkeypatch.setattr(info, "TORCH_VERSION", f"{major}.{minor}.{patch}+whatever")
    check_torch_version()


def test_next_minor_release_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    major, minor = torch.__version__.split(".")[:2]
    monkeypatch.setattr(info, "TORCH_VERSION", f"{major}.{int(minor) + 1}.0")
    with pytest.raises(
        TorchVersionMismatchError, match=rf"series \({major}\.{int(minor) + 1}\.\*\)"
    ):
        check_torch_version()


def test_cpu_build_under_cuda_torch_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(info, "TORCH_CUDA_VERSION", None if torch.version.cuda else "13.0")
    with pytest.raises(TorchVersionMismatchError, match="CUDA"):
        check_torch_version()


def test_import_fails_before_loading_extensions(tmp_path) -> None:
    """A fresh interpreter whose recorded torch version is wrong gets the clear error, not an
    undefined-symbol crash from loading kvoff._C."""
    code = (
        "import sys, types\n"
        "fake = types.ModuleType('kvoff._build_info')\n"
        "fake.TORCH_VERSION = '1.13.1'\n"
        "fake.TORCH_CUDA_VERSION = None\n"
        "sys.modules['kvoff._build_info'] = fake\n"
        "try:\n"
        "    import kvoff\n"
        "except ImportError as e:\n"
        "    print(type(e).__name__, e)\n"
        "    print('C loaded:', 'kvoff._C' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "TorchVersionMismatchError" in out.stdout
    assert "1.13.1" in out.stdout
    assert "C loaded: False" in out.stdout


def test_extensions_are_wanted_under_the_build_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_version_check, "_skipped", False)
    assert extensions_wanted(["/venv/bin/kvoff", "info"]) is True
    assert extensions_wanted(["-c"]) is True
    assert not extensions_skipped()


def test_only_kvoff_info_imports_on_without_extensions(monkeypatch: pytest.MonkeyPatch) -> None:
    """A mismatch is an ImportError for every process but `kvoff info`, which goes on without
    the compiled extensions (and says so: extensions_skipped) instead of exiting."""
    monkeypatch.setattr(info, "TORCH_VERSION", "2.0.1")
    monkeypatch.setattr(_version_check, "_skipped", False)
    for argv in (["/venv/bin/kvoff", "replay"], ["-c"], ["/venv/bin/python", "info"]):
        with pytest.raises(TorchVersionMismatchError, match=r"2\.0\.1"):
            extensions_wanted(argv)
        assert not extensions_skipped()
    assert extensions_wanted(["/venv/bin/kvoff", "info"]) is False
    assert extensions_skipped()
    monkeypatch.setattr(_version_check, "_skipped", False)
    assert extensions_wanted(["-m", "info", "--json"]) is False  # python -m kvoff info
    assert extensions_skipped()
