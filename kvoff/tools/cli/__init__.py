"""The ``kvoff`` command line (also ``python -m kvoff``): ``kvoff replay``, ``kvoff plan``,
``kvoff pool serve|status|stop``, ``kvoff info`` and ``kvoff bench
scheduler|transfer|tiers|manager-calls``.

One module per command (:mod:`.replay`, :mod:`.plan`, :mod:`.info`, :mod:`.bench` and its
``bench_*`` subcommands), each with ``add_parser(subparsers)``, which registers the command and
its run function; :mod:`.common` holds what they share. ``--json FILE`` writes a command's
results to FILE for every command (``-``: to stdout, the text to stderr); ``kvoff info`` and
``kvoff plan`` print JSON instead of text with ``--format json``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvoff._optional import MissingExtraError
from kvoff.tools.cli import bench, info, plan, pool, replay
from kvoff.tools.cli.common import EXIT_USAGE, parse_bytes, run_command

__all__ = ["build_parser", "main", "parse_bytes"]


# `kvoff --help` order
_COMMANDS = {"replay": replay, "plan": plan, "pool": pool, "bench": bench, "info": info}


def build_parser(commands: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The ``kvoff`` parser with every command (or only ``commands``); a parsed command's
    ``run(args, argv)`` runs it.

    Raises:
        KeyError: an unknown name in ``commands``.
    """
    parser = argparse.ArgumentParser(
        prog="kvoff", description="kvoff: KV-cache offloading for LLM inference engines"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name in commands or _COMMANDS:
        _COMMANDS[name].add_parser(sub)
    return parser


_build_parser = build_parser  # the name tests and tools used before the split


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvoff`` console script. Returns the process exit code (0: success;
    1: corrupted blocks or failed transfers, or `kvoff info` found a mismatch; 2: bad arguments
    or a missing optional dependency, one line on stderr naming the fix, by ``SystemExit``)."""
    words = sys.argv[1:] if argv is None else list(argv)
    try:
        # `kvoff info` diagnoses a build that does not load: it must not need the compiled
        # parts that the other commands' parsers import (policies, layouts)
        parser = build_parser(["info"] if words[:1] == ["info"] else None)
    except MissingExtraError as exc:  # a command's parser needs an optional package
        print(f"kvoff: error: {exc}", file=sys.stderr)
        raise SystemExit(EXIT_USAGE) from None
    args = parser.parse_args(argv)
    return run_command(parser, args, argv)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
