"""Mooncake-format request traces (FAST'25 release).

One JSON object per line: ``timestamp`` (ms), ``input_length`` and ``output_length`` (tokens),
``hash_ids`` (one id per ``trace_block_size`` = 512 tokens, keyed by the whole prefix: equal id
means equal block and everything before it; the last id covers the partial remainder). Two real
traces ship with kvoff under ``kvoff/data/traces`` (see ``SOURCES.md`` there); a third bundled
name, ``unique``, is derived from ``conversation`` at load time (:func:`unique_hash_ids`): the
same requests with no block shared, the zero-reuse case.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

__all__ = [
    "BUNDLED_TRACES",
    "MOONCAKE_BLOCK_SIZE",
    "UNIQUE_HASH_ID_BASE",
    "TraceRequest",
    "load_trace",
    "resolve_trace",
    "unique_hash_ids",
]

MOONCAKE_BLOCK_SIZE = 512
"""Tokens per hash id in the Mooncake traces (FAST'25 release README)."""

BUNDLED_TRACES = ("conversation", "synthetic", "unique")

_DERIVED_TRACES = {"unique": "conversation"}
"""Bundled names with no file of their own: name -> the bundled trace they are derived from."""

UNIQUE_HASH_ID_BASE = 2**36
"""First hash id :func:`unique_hash_ids` hands out: far above the Mooncake traces' ids (below
2**18), so a ``unique`` replay shares no block with a ``conversation`` replay even in a tier that
outlives one run (a disk folder, a remote namespace), and low enough that ``id * 2**20 + t``
(the vLLM replay's prompt tokens) does not wrap 64 bits."""


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
    """Path of a bundled trace by name (``conversation``, ``synthetic``, ``unique``) or of a
    file.

    A derived name (``unique``) has no file of its own: its path is that of the trace it is
    derived from (``conversation``); :func:`load_trace` applies the transform.

    Raises:
        FileNotFoundError: when ``trace`` is neither a bundled name nor an existing file; the
            message lists the bundled names.
    """
    if trace in BUNDLED_TRACES:
        name = _DERIVED_TRACES.get(trace, trace)
        ref = resources.files("kvoff") / "data" / "traces" / f"{name}_trace.jsonl"
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
        trace: a bundled trace name or a path to a JSONL file. ``unique`` reads
            ``conversation`` and makes every hash id unique (:func:`unique_hash_ids`).
        limit: read only the first ``limit`` requests.
        trace_block_size: tokens per hash id (512 for Mooncake).

    Raises:
        FileNotFoundError: see :func:`resolve_trace`.
        ValueError: for a malformed line (the message gives the file and line number): bad JSON,
            a missing field, a length or hash id that is not a JSON integer, a negative length, a
            hash id outside int64, or ``len(hash_ids) != ceil(input_length /
            trace_block_size)``; for a file that is not UTF-8 or holds no request.
    """
    path = resolve_trace(str(trace))
    out: list[TraceRequest] = []
    seen_record = False
    with path.open(encoding="utf-8") as fh:
        lines = enumerate(fh, 1)
        while True:
            try:
                lineno, line = next(lines)
            except StopIteration:
                break
            except UnicodeDecodeError as exc:
                raise ValueError(
                    f"{path}: not a UTF-8 text file ({exc.reason} at byte {exc.start}); a "
                    "Mooncake trace is JSON lines"
                ) from exc
            if limit is not None and len(out) >= limit:
                break
            if not line.strip():
                continue
            seen_record = True
            try:
                rec = json.loads(line)
                if not isinstance(rec, dict):
                    raise TypeError(f"a line is a JSON object, got {type(rec).__name__}")
                timestamp = rec["timestamp"]
                if isinstance(timestamp, bool) or not isinstance(timestamp, (int, float)):
                    raise TypeError(f"timestamp must be a number, got {timestamp!r}")
                hash_ids = rec["hash_ids"]
                if not isinstance(hash_ids, list):
                    raise TypeError(f"hash_ids must be a JSON list of ints, got {hash_ids!r}")
                req = TraceRequest(
                    float(timestamp),
                    _json_int(rec, "input_length"),
                    _json_int(rec, "output_length"),
                    tuple(_hash_id(h) for h in hash_ids),
                )
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{lineno}: not a Mooncake trace record ({exc})") from exc
            if req.input_length < 0 or req.output_length < 0:
                raise ValueError(
                    f"{path}:{lineno}: lengths must be >= 0, got input_length="
                    f"{req.input_length}, output_length={req.output_length}"
                )
            expected = math.ceil(req.input_length / trace_block_size)
            if len(req.hash_ids) != expected:
                raise ValueError(
                    f"{path}:{lineno}: input_length={req.input_length} needs "
                    f"ceil(input_length / {trace_block_size}) = {expected} hash_ids, got "
                    f"{len(req.hash_ids)}; is trace_block_size right?"
                )
            out.append(req)
    if not seen_record:
        raise ValueError(f"{path}: the trace has no requests (an empty file); give a JSONL trace")
    if str(trace) == "unique":
        return unique_hash_ids(out)
    return out


def unique_hash_ids(
    requests: list[TraceRequest], base: int = UNIQUE_HASH_ID_BASE
) -> list[TraceRequest]:
    """``requests`` with every hash id replaced by a fresh one: no two blocks of the trace, in
    one request or across requests, share an id, so a replay finds no prefix to reuse (hit rate
    and full-block maximum 0). Timestamps and lengths are kept.

    The ids are ``base, base + 1, ...`` in trace order (request by request, block by block):
    deterministic, and the first ``n`` requests get the same ids whatever the trace's length.

    Args:
        requests: the trace.
        base: the first id.

    Raises:
        ValueError: when the ids would not fit int64 (``base`` plus the trace's hash id count
            exceeds ``2**63 - 1``, or ``base`` is below ``-2**63``); lower ``base``.
    """
    total = sum(len(r.hash_ids) for r in requests)
    if base < _INT64_MIN or base + total - 1 > _INT64_MAX:
        raise ValueError(
            f"unique hash ids base={base} .. {base + total - 1} do not fit int64 "
            "[-2**63, 2**63 - 1]; lower base"
        )
    out: list[TraceRequest] = []
    next_id = base
    for r in requests:
        n = len(r.hash_ids)
        ids = tuple(range(next_id, next_id + n))
        next_id += n
        out.append(TraceRequest(r.timestamp_ms, r.input_length, r.output_length, ids))
    return out


_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def _json_int(rec: dict, key: str) -> int:
    """``rec[key]`` when it is a JSON integer (not a float, string or bool), else TypeError."""
    value = rec[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{key} must be a JSON integer, got {value!r}")
    return value


def _hash_id(value: object) -> int:
    """A hash id: a JSON integer that fits int64 (the pools key blocks by int64)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"hash_ids must hold JSON integers, got {value!r}")
    if not _INT64_MIN <= value <= _INT64_MAX:
        raise ValueError(f"hash id {value} does not fit int64 [-2**63, 2**63 - 1]")
    return value
