"""Mooncake-format request traces (FAST'25 release).

One JSON object per line: ``timestamp`` (ms), ``input_length`` and ``output_length`` (tokens),
``hash_ids`` (one id per ``trace_block_size`` = 512 tokens, keyed by the whole prefix: equal id
means equal block and everything before it; the last id covers the partial remainder). Two real
traces ship with kvoff under ``kvoff/data/traces`` (see ``SOURCES.md`` there).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

__all__ = ["BUNDLED_TRACES", "MOONCAKE_BLOCK_SIZE", "TraceRequest", "load_trace", "resolve_trace"]

MOONCAKE_BLOCK_SIZE = 512
"""Tokens per hash id in the Mooncake traces (FAST'25 release README)."""

BUNDLED_TRACES = ("conversation", "synthetic")


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace.

    Attributes:
        timestamp_ms: arrival time in milliseconds since the trace start.
        input_length: prompt tokens.
        output_length: generated tokens.
        hash_ids: prefix block ids, one per ``trace_block_size`` tokens of the prompt.
    """

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def resolve_trace(trace: str) -> Path:
    """Path of a bundled trace by name (``conversation``, ``synthetic``) or of a file.

    Raises:
        FileNotFoundError: when ``trace`` is neither a bundled name nor an existing file; the
            message lists the bundled names.
    """
    if trace in BUNDLED_TRACES:
        ref = resources.files("kvoff") / "data" / "traces" / f"{trace}_trace.jsonl"
        return Path(str(ref))
    path = Path(trace)
    if not path.is_file():
        raise FileNotFoundError(
            f"trace {trace!r} is not a bundled trace ({', '.join(BUNDLED_TRACES)}) nor a file"
        )
    return path


def load_trace(
    trace: str | Path, limit: int | None = None, trace_block_size: int = MOONCAKE_BLOCK_SIZE
) -> list[TraceRequest]:
    """Read a Mooncake-format trace.

    Args:
        trace: a bundled trace name or a path to a JSONL file.
        limit: read only the first ``limit`` requests.
        trace_block_size: tokens per hash id (512 for Mooncake).

    Raises:
        FileNotFoundError: see :func:`resolve_trace`.
        ValueError: for a malformed line (the message gives the file and line number): bad JSON,
            a missing field, a negative length, or ``len(hash_ids) != ceil(input_length /
            trace_block_size)``.
    """
    path = resolve_trace(str(trace))
    out: list[TraceRequest] = []
    with path.open() as fh:
        for lineno, line in enumerate(fh, 1):
            if limit is not None and len(out) >= limit:
                break
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                req = TraceRequest(
                    float(rec["timestamp"]),
                    int(rec["input_length"]),
                    int(rec["output_length"]),
                    tuple(int(h) for h in rec["hash_ids"]),
                )
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{lineno}: not a Mooncake trace record ({exc})") from exc
            expected = math.ceil(req.input_length / trace_block_size)
            if req.input_length < 0 or len(req.hash_ids) != expected:
                raise ValueError(
                    f"{path}:{lineno}: input_length={req.input_length} needs "
                    f"ceil(input_length / {trace_block_size}) = {expected} hash_ids, got "
                    f"{len(req.hash_ids)}; is trace_block_size right?"
                )
            out.append(req)
    return out
