"""What the ``kvoff`` commands share: argparse types, the ``--json FILE`` output (``-``: stdout),
the run record of a result, and the exit codes (0 ok; 1 corrupted, failed or mismatched; 2 bad
arguments or a missing optional dependency, a one-line message naming the value or the extra
and the fix, no traceback)."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TextIO

from kvoff._optional import MissingExtraError

__all__ = [
    "EXIT_USAGE",
    "JSON_HELP",
    "STDOUT",
    "add_format_option",
    "add_json_option",
    "check_format",
    "check_output",
    "int_at_least",
    "is_stdout",
    "non_negative_int",
    "parse_bytes",
    "positive_int",
    "run_command",
    "run_info",
    "write_json",
]

EXIT_USAGE = 2
"""Exit code of a user error: a bad argument, or an optional dependency that is not installed."""

STDOUT = "-"
"""``--json -``: the JSON document goes to stdout, the command's text to stderr."""

JSON_HELP = "write the results as JSON to FILE (-: to stdout, the text then to stderr)"
"""The help of every command's ``--json FILE``."""


def parse_bytes(text: str) -> int:
    """Parse a byte count such as ``4096``, ``512MiB``, ``2GiB`` or ``1.5GB`` (SI or IEC units);
    :func:`kvoff.config.parse_byte_size` for argparse.

    Raises:
        argparse.ArgumentTypeError: for text that is not a positive byte count.
    """
    from kvoff.config import parse_byte_size

    try:
        return parse_byte_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an int >= ``minimum`` (else ``argparse.ArgumentTypeError``)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{text!r} must be >= {minimum}")
        return value

    return parse


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)


def add_json_option(parser: argparse.ArgumentParser) -> None:
    """Adds ``--json FILE`` (a :class:`~pathlib.Path`; ``-`` for stdout) to ``parser``."""
    parser.add_argument("--json", type=Path, default=None, metavar="FILE", help=JSON_HELP)


FORMATS = ("text", "json")
"""``--format``: how ``kvoff info`` and ``kvoff plan`` print their report."""


def add_format_option(parser: argparse.ArgumentParser, what: str) -> None:
    """Adds ``--format {text,json}`` (default text): how ``what`` is printed to stdout."""
    parser.add_argument(
        "--format",
        choices=FORMATS,
        default="text",
        help=f"print {what} as text (default) or as one JSON object",
    )


def check_format(args: argparse.Namespace) -> None:
    """``--format json`` and ``--json -`` would both print to stdout.

    Raises:
        ValueError: naming both and the fix.
    """
    if args.format == "json" and is_stdout(args.json):
        raise ValueError(
            "--format json and --json - both print JSON to stdout; drop one (--json - prints "
            "the document with its run record, --format json the bare object)"
        )


def is_stdout(target: Path | str | None) -> bool:
    """Whether a ``--json`` value means stdout (``-``)."""
    return target is not None and str(target) == STDOUT


def check_output(path: Path | None, flag: str) -> None:
    """Fails before a long run when ``path`` (``--json``/``--plot``) cannot be written: an
    existing folder, or a parent that is not a folder; creates a missing parent folder.
    ``None`` and ``-`` (stdout) pass.

    Raises:
        ValueError: naming ``flag``, the path and the fix.
    """
    if path is None or is_stdout(path):
        return
    if path.is_dir():
        raise ValueError(f"{flag} {path} is a folder; give a file path, e.g. {path / 'out'}")
    parent = path.parent
    if parent.exists() and not parent.is_dir():
        raise ValueError(f"{flag} {path}: {parent} is not a folder; give a path in a folder")
    parent.mkdir(parents=True, exist_ok=True)


_json_streams: list[TextIO] = []  # the real stdout while a `--json -` command runs


@contextlib.contextmanager
def text_to_stderr(active: bool) -> Iterator[None]:
    """While ``active`` (``--json -``): ``print`` goes to stderr, :func:`write_json` to ``-``
    to stdout, so that stdout carries only the JSON document."""
    if not active:
        yield
        return
    _json_streams.append(sys.stdout)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        _json_streams.pop()


def write_json(target: Path | str, doc: dict[str, Any], note: str = "  ") -> None:
    """Writes ``doc`` (indented JSON) to the file ``target`` (creating its folder) and prints
    ``{note}JSON written to {target}``; or, for ``-``, to stdout.

    Raises:
        OSError: the file cannot be written.
    """
    text = json.dumps(doc, indent=2) + "\n"
    if is_stdout(target):
        stream = _json_streams[-1] if _json_streams else sys.stdout
        stream.write(text)
        stream.flush()
        return
    path = Path(target)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(f"{note}JSON written to {path}")


def run_info(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Where and how a result was produced (:func:`kvoff.tools.bench.run_info`: command, date,
    machine, versions, build), plus torch's CPU thread count, which the replay's copies use."""
    import torch

    from kvoff.tools.bench import run_info as bench_run_info

    info = bench_run_info(argv)
    info["machine"]["torch_threads"] = torch.get_num_threads()
    return info


def run_command(
    parser: argparse.ArgumentParser, args: argparse.Namespace, argv: Sequence[str] | None
) -> int:
    """Runs the command ``args.run(args, argv)`` that ``parser`` parsed: checks ``--json``
    first, sends the text to stderr with ``--json -``, and turns a user error into exit code 2
    with a one-line message (``SystemExit``); so is a missing optional dependency
    (:class:`kvoff._optional.MissingExtraError`: the message names ``pip install "kvoff[...]"``).
    Returns the command's exit code."""
    name = args.command
    target = getattr(args, "json", None)
    try:
        if isinstance(target, Path):  # a file: checked before a long run
            check_output(target, "--json")
        with text_to_stderr(is_stdout(target)):
            return args.run(args, argv)
    except MissingExtraError as exc:
        parser.exit(EXIT_USAGE, f"kvoff {name}: error: {exc}\n")
    except (ValueError, FileNotFoundError) as exc:
        parser.exit(2, f"kvoff {name}: error: {exc}\n")
    except OSError as exc:  # a path the user gave: a folder for a file, a file for a folder, ...
        where = f"{exc.filename}: " if exc.filename is not None else ""
        reason = exc.strerror or str(exc)
        parser.exit(2, f"kvoff {name}: error: {where}{reason}; check the path\n")
    return 2  # pragma: no cover
