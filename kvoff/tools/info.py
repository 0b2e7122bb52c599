"""``kvoff info``: what this install of kvoff contains and whether the running process fits it.

The report itself is the library's (:func:`kvoff.build_info`, in :mod:`kvoff.install_info`); this
module is what the command adds: the printed text and the exit status. It works even under a
torch the build does not fit: ``import kvoff`` then leaves the compiled extensions unloaded for
this command (:func:`kvoff._version_check.extensions_wanted`), and nothing here loads them.
"""

from __future__ import annotations

from kvoff.install_info import BuildInfo, GPUInfo, arch_covers, build_info

__all__ = ["BuildInfo", "GPUInfo", "arch_covers", "build_info", "info_report"]


def info_report(*, as_json: bool = False) -> tuple[str, int]:
    """What ``kvoff info`` prints and its exit status.

    Args:
        as_json: the report as JSON (:meth:`BuildInfo.to_json`) instead of text
            (:meth:`BuildInfo.format`).

    Returns:
        ``(text, status)``: status 0 when the runtime matches the build, 1 when
        :attr:`BuildInfo.problems` lists a mismatch.
    """
    info = build_info()
    return (info.to_json() if as_json else info.format()), (0 if info.runtime_matches else 1)
