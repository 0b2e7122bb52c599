"""Traces that are not in the repository, for checking eviction policies off the bundled traces.

``python -m kvoff.tools.trace_mix KIND OUT.jsonl [--requests N] [--seed S]`` writes a
Mooncake-format trace (see :mod:`kvoff.tools.traces`) that ``kvoff replay --trace OUT.jsonl``
reads. Kinds:

* ``sessions-near`` / ``sessions-far``: multi-turn chat sessions. Each session starts from one of
  ``prompts`` shared system prompts (chosen Zipf-popular) and every turn re-sends the whole
  conversation so far plus a few new blocks. A request goes to one of ``live`` open sessions at
  random, so a session's turn gap (its reuse distance) is about ``live`` requests: 64 (near) or
  1,024 (far). 30 % of requests are one-shot prompts never seen again.
* ``scan``: the far sessions under a scan: 70 % of requests are long one-shot documents.
* ``rag``: retrieval-style one-shot requests: a Zipf-popular document of 4..32 blocks, then a
  unique question; no sessions.
* ``interleave``: the two bundled traces merged by time (the synthetic one stretched to the
  conversation's hour, its ids moved out of the conversation's range).
* ``shuffle``: the conversation trace with the order of requests within each 60 s window
  shuffled (the same reuse, another order).

Hash ids follow the Mooncake rule: an id names a block and everything before it, so two prompts
share an id only if they share the whole prefix up to it. No constant here is a policy's.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from kvoff.tools.traces import MOONCAKE_BLOCK_SIZE, TraceRequest, load_trace

__all__ = ["KINDS", "make_trace", "write_trace"]

KINDS = ("sessions-near", "sessions-far", "scan", "rag", "interleave", "shuffle")


def _zipf(rng: np.random.Generator, n: int, a: float = 1.1) -> int:
    """A rank in [0, n) with P(k) proportional to 1 / (k + 1)^a."""
    w = 1.0 / np.arange(1, n + 1) ** a
    return int(rng.choice(n, p=w / w.sum()))


def _sessions(
    rng: np.random.Generator, n: int, live: int, one_shot: float, one_shot_blocks: tuple[int, int]
) -> Iterator[list[int]]:
    prompts, next_id = 32, 1 << 20
    system = [list(range(p * 16, p * 16 + 2 + p % 7)) for p in range(prompts)]  # 2..8 blocks
    open_: list[list[int]] = []
    for _ in range(n):
        if rng.random() < one_shot:
            k = int(rng.integers(*one_shot_blocks))
            yield [*system[_zipf(rng, prompts)], *range(next_id, next_id + k)]
            next_id += k
            continue
        if len(open_) < live:
            open_.append(list(system[_zipf(rng, prompts)]))
        i = int(rng.integers(len(open_)))
        k = int(rng.integers(1, 6))
        open_[i] += range(next_id, next_id + k)
        next_id += k
        yield list(open_[i])
        if rng.random() < 0.15 or len(open_[i]) > 120:  # a session ends after ~7 turns
            open_[i] = open_[-1]
            open_.pop()


def _rag(rng: np.random.Generator, n: int) -> Iterator[list[int]]:
    docs, next_id = 5000, 1 << 24
    sizes = rng.integers(4, 33, size=docs)
    for _ in range(n):
        d = _zipf(rng, docs, 0.9)
        yield [*range(d * 64, d * 64 + int(sizes[d])), next_id]
        next_id += 1


def make_trace(kind: str, requests: int = 12000, seed: int = 0) -> list[TraceRequest]:
    """The trace ``kind`` (see the module docstring); ``requests`` applies to the generated
    kinds (``interleave`` and ``shuffle`` keep every bundled request).

    Raises:
        ValueError: an unknown kind.
    """
    rng = np.random.default_rng(seed)
    if kind == "interleave":
        conv, syn = load_trace("conversation"), load_trace("synthetic")
        scale = conv[-1].timestamp_ms / max(syn[-1].timestamp_ms, 1.0)
        shift = 1 + max(h for r in conv for h in r.hash_ids)
        moved = [
            TraceRequest(
                r.timestamp_ms * scale,
                r.input_length,
                r.output_length,
                tuple(h + shift for h in r.hash_ids),
            )
            for r in syn
        ]
        return sorted([*conv, *moved], key=lambda r: r.timestamp_ms)  # stable: ties keep order
    if kind == "shuffle":
        conv = load_trace("conversation")
        window = [int(r.timestamp_ms // 60_000) for r in conv]
        keys = rng.random(len(conv))
        order = sorted(range(len(conv)), key=lambda i: (window[i], keys[i]))
        return [conv[i] for i in order]
    if kind in ("sessions-near", "sessions-far", "scan"):
        live = 64 if kind == "sessions-near" else 1024
        one_shot, blocks = (0.7, (16, 64)) if kind == "scan" else (0.3, (2, 24))
        prompts = _sessions(rng, requests, live, one_shot, blocks)
    elif kind == "rag":
        prompts = _rag(rng, requests)
    else:
        raise ValueError(f"unknown trace kind {kind!r}; choose from: {', '.join(KINDS)}")
    out = []
    for i, ids in enumerate(prompts):
        # The last id covers a partial remainder, as in Mooncake: input_length fits len(ids).
        tokens = (len(ids) - 1) * MOONCAKE_BLOCK_SIZE + int(rng.integers(1, MOONCAKE_BLOCK_SIZE))
        out.append(TraceRequest(i * 250.0, tokens, int(rng.integers(1, 512)), tuple(ids)))
    return out


def write_trace(requests: list[TraceRequest], path: str | Path) -> None:
    """Writes ``requests`` as Mooncake JSONL."""
    with Path(path).open("w") as fh:
        for r in requests:
            rec = {
                "timestamp": int(r.timestamp_ms) if math.isfinite(r.timestamp_ms) else 0,
                "input_length": r.input_length,
                "output_length": r.output_length,
                "hash_ids": list(r.hash_ids),
            }
            fh.write(json.dumps(rec) + "\n")


def main(argv: list[str] | None = None) -> int:
    """``python -m kvoff.tools.trace_mix KIND OUT``: writes trace ``KIND`` (``--requests``
    requests for the generated kinds, seeded by ``--seed``) as JSONL to ``OUT``. Returns the
    exit status (0).

    Raises:
        SystemExit: bad arguments (argparse names them).
        OSError: ``OUT`` cannot be written.
    """
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("kind", choices=KINDS)
    parser.add_argument("out", help="the JSONL file to write")
    parser.add_argument("--requests", type=int, default=12000, help="(generated kinds)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    write_trace(make_trace(args.kind, args.requests, args.seed), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
