"""Package metadata that depends on the torch kvoff is built against.

A compiled torch extension loads only under the torch series it was built for, and a CUDA build
only under torch's CUDA version, so a kvoff wheel carries both in its metadata, the way torch and
vLLM label their builds:

* the version gets a PEP 440 local label: ``0.1.0+cpu`` on a CPU torch, ``0.1.0+cu130`` on a
  torch built for CUDA 13.0;
* the ``torch`` requirement is pinned to the series (major.minor) it was built against:
  ``torch==2.13.*``.

This module is used twice and so imports nothing but the standard library (and torch, lazily):

* at build time, by scikit-build-core, as the dynamic-metadata provider for ``version`` and
  ``dependencies`` (``[tool.scikit-build.metadata]`` in ``pyproject.toml`` loads it from
  ``kvoff/`` as the top-level module ``_build_metadata``);
* at run time, as ``kvoff._build_metadata``, by :func:`kvoff.build_info` to say which label and
  torch series an install expects.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

#: kvoff's release, without the local label.
BASE_VERSION = "0.1.0"

#: Requirements other than torch (torch is added by :func:`dependencies`, pinned).
BASE_DEPENDENCIES: tuple[str, ...] = (
    "numpy>=1.24",
    "pydantic>=2.5",
    "pydantic-settings>=2.4",  # 2.4: sources see the higher levels (current_state)
    "pyyaml>=6",
    "tqdm>=4.60",
    "xxhash>=3",  # block checksums and layout fingerprints of the secondary tiers
    "blake3>=1",  # the tiers' block MAC (shared_secret); imported only when a secret is set
)

_RELEASE = re.compile(r"^(\d+)\.(\d+)(?:\.\d+)*")
_CUDA = re.compile(r"^(\d+)\.(\d+)")


def local_label(torch_cuda_version: str | None) -> str:
    """The local version label of a kvoff built against a torch with this CUDA version.

    Args:
        torch_cuda_version: ``torch.version.cuda`` of the build's torch (``"13.0"``, ``"12.8"``),
            or ``None`` for a CPU build of torch.

    Returns:
        ``"cpu"`` for ``None``, else ``"cu"`` + major + minor (``"cu130"``, ``"cu128"``): the
        labels torch's own wheels use.

    Raises:
        ValueError: when ``torch_cuda_version`` is not of the form ``MAJOR.MINOR[...]``.
    """
    if not torch_cuda_version:
        return "cpu"
    m = _CUDA.match(torch_cuda_version)
    if m is None:
        raise ValueError(
            f"torch CUDA version {torch_cuda_version!r} is not MAJOR.MINOR; kvoff cannot name "
            "its wheel. Check `python -c 'import torch; print(torch.version.cuda)'`."
        )
    return f"cu{int(m[1])}{int(m[2])}"


def torch_series(torch_version: str) -> str:
    """The release series (``"2.13"``) of a torch version string (``"2.13.0+cpu"``).

    Raises:
        ValueError: when the version does not start with ``MAJOR.MINOR``.
    """
    m = _RELEASE.match(torch_version)
    if m is None:
        raise ValueError(
            f"torch version {torch_version!r} does not start with MAJOR.MINOR; kvoff cannot pin "
            "the torch it needs. Check `python -c 'import torch; print(torch.__version__)'`."
        )
    return f"{int(m[1])}.{int(m[2])}"


def torch_requirement(torch_version: str) -> str:
    """The pinned torch requirement of a kvoff built against ``torch_version``.

    ``"2.13.0+cpu"`` gives ``"torch==2.13.*"``: any release of the same series, CPU or CUDA
    (PEP 440 ignores a candidate's local label when the specifier has none). Patch releases of
    one torch series keep the C++ ABI that extensions link against; a new minor release does
    not, hence the pin (flash-attention and xformers build per series the same way). Whether a
    CUDA kvoff meets a torch of its CUDA version is checked at import
    (:mod:`kvoff._version_check`): a requirement cannot name local labels portably.
    """
    return f"torch=={torch_series(torch_version)}.*"


def full_version(torch_cuda_version: str | None) -> str:
    """``BASE_VERSION`` with the local label of :func:`local_label` (``"0.1.0+cu130"``)."""
    return f"{BASE_VERSION}+{local_label(torch_cuda_version)}"


def dependencies(torch_version: str) -> list[str]:
    """Every runtime requirement of a kvoff built against ``torch_version``: the pinned torch
    (:func:`torch_requirement`) then :data:`BASE_DEPENDENCIES`."""
    return [torch_requirement(torch_version), *BASE_DEPENDENCIES]


def _installed_torch() -> tuple[str, str | None]:
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - exercised only on a machine without torch
        raise RuntimeError(
            "kvoff builds against the installed torch, but `import torch` failed. Install torch "
            "first (for example `pip install torch==2.13.0`), then build kvoff without build "
            "isolation: `pip install --no-build-isolation .` (or `bash .ci/build-wheel`)."
        ) from exc
    return str(torch.__version__), torch.version.cuda


def dynamic_metadata(field: str, settings: Mapping[str, Any] | None = None) -> str | list[str]:
    """scikit-build-core's dynamic-metadata hook: ``version`` and ``dependencies`` from the
    installed torch.

    Args:
        field: ``"version"`` or ``"dependencies"``.
        settings: the provider's table from ``pyproject.toml``; must be empty.

    Raises:
        RuntimeError: for another field, for settings, or when torch cannot be imported.
    """
    if settings:
        raise RuntimeError(f"kvoff's metadata provider takes no settings, got {dict(settings)}")
    torch_version, torch_cuda = _installed_torch()
    if field == "version":
        return full_version(torch_cuda)
    if field == "dependencies":
        return dependencies(torch_version)
    raise RuntimeError(
        f"kvoff's metadata provider computes 'version' and 'dependencies', not {field!r}"
    )
