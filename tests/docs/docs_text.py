"""Reading the user docs (README.md and docs/*.md) for the docs tests: the files, their fenced
code blocks and inline code spans, their headings' anchors, and the ``kvoff`` command's parser."""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", flags=re.S | re.M)
_SPAN = re.compile(r"`([^`]+)`")


def doc_files() -> list[Path]:
    """README.md and every Markdown page under docs/, in a stable order."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def rel(path: Path) -> str:
    """``path`` relative to the repository root, for messages."""
    return str(path.relative_to(ROOT))


@dataclass(frozen=True)
class CodeBlock:
    """One fenced code block: its file, its info string (``bash``, ``python``...), its text."""

    path: Path
    lang: str
    text: str


def code_blocks(path: Path) -> list[CodeBlock]:
    """The fenced code blocks of ``path`` (an indented fence inside a list item counts)."""
    text = _dedent_fences(path.read_text())
    return [CodeBlock(path, m.group(1).strip(), m.group(2)) for m in _FENCE.finditer(text)]


def inline_spans(path: Path) -> list[str]:
    """The inline code spans of ``path`` outside fenced blocks, line breaks made spaces."""
    text = _FENCE.sub("", _dedent_fences(path.read_text()))
    return [" ".join(m.group(1).split()) for m in _SPAN.finditer(text)]


def _dedent_fences(text: str) -> str:
    """Fences indented under a list item, moved to the margin (with their contents)."""
    out: list[str] = []
    indent: str | None = None
    for line in text.splitlines():
        stripped = line.lstrip(" ")
        if stripped.startswith("```"):  # opens or closes a fence
            indent = line[: len(line) - len(stripped)] if indent is None else None
            out.append(stripped)
        elif indent and line.startswith(indent):
            out.append(line[len(indent) :])
        else:
            out.append(line)
    return "\n".join(out) + "\n"


def anchors(path: Path) -> set[str]:
    """The anchors GitHub gives the headings of ``path`` (lower case, punctuation dropped,
    spaces made hyphens; a repeated heading gets ``-1``, ``-2``...)."""
    text = _FENCE.sub("", _dedent_fences(path.read_text()))
    seen: dict[str, int] = {}
    out: set[str] = set()
    for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def kvoff_parser() -> argparse.ArgumentParser:
    """The ``kvoff`` command's real argparse parser, built by the CLI itself.

    Raises:
        AssertionError: when ``kvoff.tools.cli`` has no parser-building function.
    """
    from kvoff.tools import cli

    for name in ("build_parser", "_build_parser"):
        build = getattr(cli, name, None)
        if callable(build):
            parser = build()
            assert isinstance(parser, argparse.ArgumentParser), name
            return parser
    raise AssertionError("kvoff.tools.cli has no build_parser(): how do the docs tests get it?")


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """The subcommands of ``parser`` by name ({} for a parser without subcommands)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def options(parser: argparse.ArgumentParser) -> set[str]:
    """Every option string ``parser`` accepts (``--json``, ``-h``, ``--help``...)."""
    return {s for action in parser._actions for s in action.option_strings}
