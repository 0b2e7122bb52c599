"""``kvoff info``: what this install of kvoff contains and whether this process matches it
(:func:`kvoff.tools.info.build_info`)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from kvoff.tools.cli.common import (
    add_format_option,
    add_json_option,
    check_format,
    run_info,
    write_json,
)

__all__ = ["add_parser", "run"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Registers ``kvoff info`` on the ``kvoff`` subparsers."""
    ip = sub.add_parser(
        "info",
        help="what this install of kvoff contains and whether this process matches it",
        description=(
            "Print kvoff's version (with its wheel label), the torch and CUDA it was built "
            "against, the GPU architectures compiled, the copy mechanisms usable here, the "
            "compilers, and whether the running torch, CUDA and GPUs match the build. Exits 1 "
            "when they do not."
        ),
    )
    add_format_option(ip, "the report")
    add_json_option(ip)
    ip.set_defaults(run=run)


def run(args: argparse.Namespace, argv: Sequence[str] | None) -> int:
    """``kvoff info``: prints the report; with ``--json FILE`` writes ``{"run", "info"}``.
    Returns 0 when the runtime matches the build, else 1.

    Raises:
        ValueError: ``--format json`` with ``--json -``.
    """
    from kvoff.tools.info import build_info

    check_format(args)
    info = build_info()
    print(info.to_json() if args.format == "json" else info.format())
    if args.json is not None:
        write_json(args.json, {"run": run_info(argv), "info": info.as_dict()})
    return 0 if info.runtime_matches else 1
