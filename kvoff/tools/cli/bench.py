"""``kvoff bench``: the benchmarks, one module each (:mod:`.bench_scheduler`,
:mod:`.bench_transfer`, :mod:`.bench_tiers`, :mod:`.bench_node_pool`; ``manager-calls`` is
:mod:`kvoff.tools.bench_manager_calls`'s own)."""

from __future__ import annotations

import argparse
import json
import tempfile
from collections.abc import Sequence
from pathlib import Path

from kvoff.tools.cli import bench_node_pool, bench_scheduler, bench_tiers, bench_transfer
from kvoff.tools.cli.common import is_stdout, write_json

__all__ = ["add_parser"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Registers ``kvoff bench`` and its benchmarks on the ``kvoff`` subparsers."""
    from kvoff.tools.bench_manager_calls import add_manager_calls_parser

    bp = sub.add_parser("bench", help="benchmarks", description="kvoff benchmarks")
    bench_sub = bp.add_subparsers(dest="bench_command", required=True)
    for command in (bench_scheduler, bench_transfer, bench_tiers, bench_node_pool):
        command.add_parser(bench_sub)
    add_manager_calls_parser(bench_sub)
    bench_sub.choices["manager-calls"].set_defaults(run=_run_manager_calls)


def _run_manager_calls(args: argparse.Namespace, argv: Sequence[str] | None) -> int:
    """``kvoff bench manager-calls`` (:func:`kvoff.tools.bench_manager_calls.run_manager_calls_cli`,
    which writes ``--json`` FILE itself; for ``-`` it writes a temporary file that is then
    printed). Returns its exit code.

    Raises:
        ValueError / FileNotFoundError / RuntimeError: as ``run_manager_calls_cli``.
    """
    from kvoff.tools.bench_manager_calls import run_manager_calls_cli

    if not is_stdout(args.json):
        return run_manager_calls_cli(args, argv)
    with tempfile.TemporaryDirectory(prefix="kvoff-manager-calls-json-") as tmp:
        path = Path(tmp) / "manager-calls.json"
        code = run_manager_calls_cli(argparse.Namespace(**{**vars(args), "json": path}), argv)
        if path.is_file():
            write_json(args.json, json.loads(path.read_text()))
    return code
