"""A missing optional dependency (redis-py, matplotlib, vLLM) gives one line naming the extra
to install, from the ``kvoff`` command (exit code 2, no traceback) and from the library
(:class:`kvoff._optional.MissingExtraError`, an ``ImportError``).

Each case runs a real Python subprocess in which a ``sys.meta_path`` finder makes the package
look uninstalled: importing it, or anything under it, raises ``ModuleNotFoundError`` with the
package's name, as Python does when the package is absent."""

from __future__ import annotations

import importlib
import json
import os
import pickle
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvoff._build_metadata import BASE_DEPENDENCIES
from kvoff._optional import (
    EXTRAS,
    VLLM_TESTED_VERSIONS,
    MissingExtraError,
    extra_imports,
    installed_version,
    require,
    vllm_release_tested,
)

REDIS_LINE = (
    "the Redis Cluster tier (remote_url, --remote-url) needs redis-py, which is not installed: "
    'pip install "kvoff[redis]"'
)
VLLM_INSTALL = (
    'pip install "kvoff[vllm]" (vLLM\'s CPU build; on a GPU machine install vllm==0.32.0 '
    "itself instead)"
)

_BLOCKER = textwrap.dedent(
    """\
    import sys

    BLOCKED = set(sys.argv[1].split(","))

    class _Uninstalled:
        # a finder that makes the BLOCKED packages look uninstalled
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, _Uninstalled())
    del sys.argv[1]
    """
)

# `python -m kvoff ARGS` with the blocker installed first
_CLI = _BLOCKER + textwrap.dedent(
    """\
    import runpy

    sys.argv[0] = "kvoff"
    runpy.run_module("kvoff", run_name="__main__", alter_sys=True)
    """
)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVOFF_")}
    env["PYTHONWARNINGS"] = "ignore"
    return env


def _run(
    script: str, blocked: str, *args: str, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", script, blocked, *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
        env=_env(),
        cwd=cwd,
    )


def _cli_fails(blocked: str, *argv: str, cwd: Path | None = None) -> str:
    """Runs ``python -m kvoff argv`` without the ``blocked`` packages; asserts exit code 2, one
    line on stderr and no traceback; returns that line."""
    proc = _run(_CLI, blocked, *argv, cwd=cwd)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


def _library(blocked: str, body: str, *args: str) -> dict[str, object]:
    """Runs ``body`` (which must set ``result``, a JSON-able dict; ``caught(call)`` reports
    the :class:`MissingExtraError` a call raises) without the ``blocked`` packages, with
    ``args`` in ``sys.argv[1:]``; returns ``result``."""
    script = _BLOCKER + "import json\n" + _CATCH + textwrap.dedent(body)
    script += "\nprint(json.dumps(result))\n"
    proc = _run(script, blocked, *args)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


# how a library call's MissingExtraError is reported by the subprocess
_CATCH = """\
def caught(call):
    from kvoff._optional import MissingExtraError
    try:
        call()
    except MissingExtraError as exc:
        return {"type": type(exc).__name__, "import_error": isinstance(exc, ImportError),
                "message": str(exc), "extra": exc.extra, "package": exc.package,
                "name": exc.name}
    return {"type": None}
"""


# --- redis-py ---------------------------------------------------------------------------------


def test_cli_replay_remote_url_without_redis() -> None:
    line = _cli_fails("redis", "replay", "--remote-url", "redis://127.0.0.1:1", "--limit", "2")
    assert line == f"kvoff replay: error: {REDIS_LINE}"


def test_config_and_library_without_redis() -> None:
    result = _library(
        "redis",
        """
        from kvoff.config import OffloadingConfig
        from kvoff.tiers.block_format import BlockFormat
        from kvoff.tiers.coordinator import make_tiers, tiers_from_config

        config = OffloadingConfig(cpu_bytes_to_use=1 << 20, remote_url="redis://127.0.0.1:1")
        fmt = BlockFormat(bytes(16), 64)

        def import_tier():
            import kvoff.tiers.redis_cluster  # noqa: F401

        result = {
            "config_url": config.remote_url,
            "from_config": caught(lambda: tiers_from_config(config, fmt)),
            "make_tiers": caught(lambda: make_tiers(fmt, remote_url="redis://127.0.0.1:1")),
            "module": caught(import_tier),
            "no_remote": make_tiers(fmt),
        }
        """,
    )
    # the configuration itself does not need redis-py: only making the tier does
    assert result["config_url"] == "redis://127.0.0.1:1"
    assert result["no_remote"] == []
    expected = {
        "type": "MissingExtraError",
        "import_error": True,
        "message": REDIS_LINE,
        "extra": "redis",
        "package": "redis-py",
        "name": "redis",
    }
    assert result["from_config"] == expected
    assert result["make_tiers"] == expected
    assert result["module"] == expected


# --- matplotlib -------------------------------------------------------------------------------


def test_cli_replay_plot_without_matplotlib(tmp_path: Path) -> None:
    png = tmp_path / "curves.png"
    argv = ["replay", "--sweep-capacity", "4", "--policies", "lru", "--limit", "2"]
    line = _cli_fails("matplotlib", *argv, "--plot", str(png))
    assert line == (
        "kvoff replay: error: kvoff replay --plot needs matplotlib, which is not installed: "
        'pip install "kvoff[plot]"'
    )
    assert not png.exists()


def test_plot_sweep_without_matplotlib(tmp_path: Path) -> None:
    png = tmp_path / "curves.png"
    result = _library(
        "matplotlib",
        f"""
        from kvoff.tools.policy_sweep import run_policy_sweep, plot_sweep
        from kvoff.tools.replay import ReplayConfig

        sweep = run_policy_sweep(ReplayConfig(limit=2), [4], ["lru"])
        result = {{"requests": sweep.requests,
                   "plot": caught(lambda: plot_sweep(sweep, {str(png)!r}))}}
        """,
    )
    assert result["requests"] == 2
    assert result["plot"] == {
        "type": "MissingExtraError",
        "import_error": True,
        "message": "drawing hit-rate curves (--plot, plot_sweep) needs matplotlib, which is not "
        'installed: pip install "kvoff[plot]"',
        "extra": "plot",
        "package": "matplotlib",
        "name": "matplotlib",
    }
    assert not png.exists()


# --- vLLM -------------------------------------------------------------------------------------


def test_import_integration_without_vllm() -> None:
    result = _library(
        "vllm",
        """
        import sys

        def import_integration():
            import kvoff.integrations.vllm  # noqa: F401

        def import_connector():  # a submodule: the package's __init__ runs first
            import kvoff.integrations.vllm.connector  # noqa: F401

        result = {
            "package": caught(import_integration),
            "submodule": caught(import_connector),
            "left_behind": sorted(m for m in sys.modules if m.startswith("kvoff.integrations.")),
        }
        """,
    )
    expected = {
        "type": "MissingExtraError",
        "import_error": True,
        "message": f"kvoff.integrations.vllm needs vLLM, which is not installed: {VLLM_INSTALL}",
        "extra": "vllm",
        "package": "vLLM",
        "name": "vllm",
    }
    assert result["package"] == expected
    assert result["submodule"] == expected
    assert result["left_behind"] == []  # no half-imported module stays in sys.modules


def test_import_integration_with_vllm_set_to_none() -> None:
    # `sys.modules["vllm"] = None` (the other usual way to hide a package) is reported the same
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; sys.modules['vllm'] = None\nimport kvoff.integrations.vllm",
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
        env=_env(),
    )
    assert proc.returncode == 1
    assert proc.stderr.splitlines()[-1] == (
        "kvoff._optional.MissingExtraError: kvoff.integrations.vllm needs vLLM, which is not "
        f"installed: {VLLM_INSTALL}"
    )


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (
            ["replay", "--engine", "vllm", "--limit", "2"],
            f"kvoff replay: error: kvoff replay --engine vllm needs vLLM, which is not "
            f"installed: {VLLM_INSTALL}",
        ),
        (
            ["bench", "scheduler", "--vs-vllm"],
            f"kvoff bench: error: kvoff bench scheduler --vs-vllm needs vLLM, which is not "
            f"installed: {VLLM_INSTALL}",
        ),
    ],
)
def test_cli_without_vllm(argv: list[str], line: str, tmp_path: Path) -> None:
    assert _cli_fails("vllm", *argv, cwd=tmp_path) == line
    assert list(tmp_path.iterdir()) == []  # nothing was written before the check


# --- blake3 (a dependency of kvoff, imported only for the tiers' block MAC) -------------------

BLAKE3_LINE = (
    "the block MAC of the disk and Redis tiers (shared_secret) needs blake3, which is not "
    'installed: pip install "blake3>=1" (a dependency of kvoff)'
)


def test_shared_secret_without_blake3(tmp_path: Path) -> None:
    result = _library(
        "blake3",
        """
        import sys

        import numpy as np

        from kvoff.config import OffloadingConfig
        from kvoff.tiers.block_format import BlockFormat, check_block, encode_header
        from kvoff.tiers.coordinator import tiers_from_config

        fp = bytes(16)
        plain = BlockFormat(fp, 4096)  # no secret: blake3 is not needed
        data = np.zeros(4096, np.uint8)
        ok = check_block(plain, b"k" * 16, encode_header(plain, b"k" * 16, data), data)
        secret = b"0123456789abcdef-secret"
        config = OffloadingConfig(
            num_cpu_blocks=4, disk_path=sys.argv[1], disk_bytes=1 << 30,
            shared_secret=secret.decode(),
        )
        result = {
            "plain": ok,
            "format": caught(lambda: BlockFormat(fp, 4096, shared_secret=secret)),
            "tiers": caught(lambda: tiers_from_config(config, plain)),
            "imported": "blake3" in sys.modules and sys.modules["blake3"] is not None,
        }
        """,
        str(tmp_path / "disk"),
    )
    expected = {
        "type": "MissingExtraError",
        "import_error": True,
        "message": BLAKE3_LINE,
        "extra": None,
        "package": "blake3",
        "name": "blake3",
    }
    assert result == {"plain": None, "format": expected, "tiers": expected, "imported": False}
    assert EXTRAS["blake3"].install == 'pip install "blake3>=1" (a dependency of kvoff)'
    assert not (tmp_path / "disk").exists()  # refused before any tier was made


# --- the helper -------------------------------------------------------------------------------


def test_extras_match_pyproject() -> None:
    import tomllib

    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    extras = pyproject["project"]["optional-dependencies"]
    for module, spec in EXTRAS.items():
        if spec.extra is None:  # a dependency of kvoff itself, imported by one feature
            assert spec.requirement in BASE_DEPENDENCIES, module
            continue
        assert spec.extra in extras, f"{module}: kvoff[{spec.extra}] is not in pyproject.toml"
    assert extras["redis"] == ["redis[hiredis]>=5"]
    assert extras["plot"] == ["matplotlib>=3.5"]
    assert any(r.startswith("vllm") for r in extras["vllm"])
    # what `kvoff info` looks the packages up by: each extra's requirement names a distribution
    for module, spec in EXTRAS.items():
        required = extras[spec.extra] if spec.extra is not None else [spec.requirement]
        names = {re.split(r"[\[<>=!~ ]", r, maxsplit=1)[0] for r in required}
        assert names & set(spec.distributions), (module, names, spec.distributions)
    # the extra installs a vLLM release the integration is tested with
    (vllm_pin,) = extras["vllm"]
    assert vllm_release_tested(vllm_pin.split("==", 1)[1]), vllm_pin
    assert f"vllm=={VLLM_TESTED_VERSIONS[-1]}" in EXTRAS["vllm"].install


def test_vllm_release_tested_ignores_a_local_label() -> None:
    assert vllm_release_tested("0.32.0") and vllm_release_tested("0.32.0+cu130")
    assert not vllm_release_tested("0.34.0") and not vllm_release_tested("0.32.0rc1")
    assert not vllm_release_tested("0.32")


def test_installed_version_reads_metadata_without_importing() -> None:
    import importlib.metadata

    for module, spec in EXTRAS.items():
        found = installed_version(module)
        if found is not None:
            assert found[0] in spec.distributions
            assert found[1] == importlib.metadata.version(found[0])
    assert installed_version("blake3") == ("blake3", importlib.metadata.version("blake3"))
    with pytest.raises(KeyError):
        installed_version("numpy")


def test_require_refuses_a_package_that_is_not_an_extra() -> None:
    with pytest.raises(KeyError, match="'json' is not an optional package of kvoff"):
        require("json", "a test")


@pytest.fixture
def fake_matplotlib(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A ``matplotlib`` package in ``tmp_path`` ahead of the real one (its ``__init__.py``
    returned); the real modules are put back afterwards."""
    package = tmp_path / "site" / "matplotlib"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")

    def ours() -> list[str]:
        return [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]

    saved = {m: sys.modules.pop(m) for m in ours()}
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    try:
        yield package / "__init__.py"
    finally:
        for m in ours():
            del sys.modules[m]
        sys.modules.update(saved)


def test_broken_install_keeps_its_own_error(fake_matplotlib: Path) -> None:
    # an installed package that fails to import is not "missing": its own error goes through
    fake_matplotlib.write_text("raise ImportError('libfreetype.so.6: cannot open')\n")
    with pytest.raises(ImportError, match="libfreetype") as info:
        require("matplotlib", "a test")
    assert not isinstance(info.value, MissingExtraError)
    # a missing submodule of an installed package (another version) is not "missing" either
    fake_matplotlib.write_text("")
    importlib.invalidate_caches()
    with pytest.raises(ModuleNotFoundError) as info2:
        require("matplotlib.nonexistent_submodule", "a test")
    assert not isinstance(info2.value, MissingExtraError)
    assert info2.value.name == "matplotlib.nonexistent_submodule"
    assert require("matplotlib", "a test").__file__ == str(fake_matplotlib)


def test_extra_imports_translates_only_its_package() -> None:
    with pytest.raises(MissingExtraError) as info, extra_imports("redis", "a feature"):
        raise ModuleNotFoundError("No module named 'redis'", name="redis")
    assert str(info.value) == (
        'a feature needs redis-py, which is not installed: pip install "kvoff[redis]"'
    )
    assert "\n" not in str(info.value)
    # another package: left alone
    with pytest.raises(ModuleNotFoundError) as other, extra_imports("redis", "a feature"):
        raise ModuleNotFoundError("No module named 'hiredis'", name="hiredis")
    assert not isinstance(other.value, MissingExtraError)
    with (
        pytest.raises(KeyError, match="'numpy' is not an optional package"),
        extra_imports("numpy", "a feature"),
    ):
        pass


def test_missing_extra_error_pickles() -> None:
    exc = MissingExtraError("kvoff replay --plot", "matplotlib")
    copy = pickle.loads(pickle.dumps(exc))
    assert type(copy) is MissingExtraError
    assert str(copy) == str(exc)
    assert (copy.feature, copy.package, copy.extra, copy.name) == (
        "kvoff replay --plot",
        "matplotlib",
        "plot",
        "matplotlib",
    )
    assert copy.install == 'pip install "kvoff[plot]"'
